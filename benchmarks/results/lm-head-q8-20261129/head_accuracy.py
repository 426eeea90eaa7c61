"""--quantize-lm-head q8_0 against the checkpoint's bf16 lm_head on the same W8A8 SmolLM2: the
prompt tokens' negative log-likelihood (perplexity) over local text, the share of positions
whose top-1 token agrees, and greedy continuations token for token.
    python head_accuracy.py <model dir> <text files...>"""
import math, sys
from pathlib import Path
from kubeinfer.server.engine.llm import LLM
from kubeinfer.server.engine.sampling_params import SamplingParams

model, files = sys.argv[1], sys.argv[2:]
text = "\n\n".join(Path(f).read_text() for f in files)
engines = {head: LLM(model=model, kv_cache_memory=1 << 30, enable_prefix_caching=False, quantize_lm_head=head)
           for head in ("none", "q8_0")}
tokenizer = engines["none"].engine.tokenizer
ids = tokenizer.encode(text)
chunks = [ids[i:i + 512] for i in range(0, len(ids) - 512, 512)][:40]
score = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
nll, top1 = {}, {}
for head, llm in engines.items():
    outs = llm.generate(chunks, score)
    total, agree, count = 0.0, [], 0
    for chunk, out in zip(chunks, outs):
        for token, entry in zip(chunk[1:], out.prompt_logprobs[1:]):
            total -= entry[token].logprob
            count += 1
            agree.append(max(entry, key=lambda t: entry[t].logprob))
    nll[head], top1[head] = total / count, agree
    print(f"{head}: {count} positions, NLL {nll[head]:.5f}, perplexity {math.exp(nll[head]):.4f}")
same = sum(a == b for a, b in zip(top1["none"], top1["q8_0"]))
print(f"top-1 token agrees at {same} of {len(top1['none'])} positions ({same / len(top1['none']):.2%})")
prompts = [chunk[:64] for chunk in chunks]
greedy = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
runs = {head: [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] for head, llm in engines.items()}
identical = sum(a == b for a, b in zip(runs["none"], runs["q8_0"]))
first_diff = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None) for a, b in zip(runs["none"], runs["q8_0"])]
print(f"greedy 64-token continuations identical: {identical} of {len(prompts)}; first differing position "
      f"where they differ: {sorted(d for d in first_diff if d is not None)}")

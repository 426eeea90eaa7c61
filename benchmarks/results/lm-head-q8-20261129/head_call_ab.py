"""The lm_head call of SmolLM2 W8A8 at 32 rows, the checkpoint's bf16 head (oneDNN) against the
Q8_0 tiles `--quantize-lm-head auto` gives it, alternated call by call in one process, each call
after a 400 MB read so its weights come from DRAM as in a decode step."""
import statistics, time, torch
from kubeinfer.server.engine.llm import LLM
llm = LLM(model="/root/.cache/kubeinfer/peers/smollm2-w8a8", kv_cache_memory=1 << 28, quantize_lm_head="auto")
model = llm.engine.loaded.model
q8 = model.quantized_tied_head
assert q8 is not None
big = torch.empty(400 << 20, dtype=torch.uint8); big.fill_(1)
hidden = torch.randn(32, 576, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
times = {"bf16": [], "q8_0": []}
for i in range(60):
    for name in ("bf16", "q8_0"):
        model.quantized_tied_head = q8 if name == "q8_0" else None
        big.view(torch.int32).max()
        start = time.perf_counter(); model.logits(hidden); times[name].append(time.perf_counter() - start)
for name, values in times.items():
    print(f"{name}: median {statistics.median(values) * 1e3:.2f} ms, p10 {sorted(values)[6] * 1e3:.2f}, p90 {sorted(values)[54] * 1e3:.2f} (60 calls)")

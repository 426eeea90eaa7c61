"""Per burst: when its requests entered the ASGI app, reached generate() and the engine, and the prefill steps."""
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]).read().replace('\0', '').splitlines() if l.strip()]
def t(r): return next(r[k] for k in ('asgi', 'arrive', 'add', 't0') if k in r)
bursts, cur, last = [], None, None
for r in rows:
    if 'asgi' in r and (last is None or r['asgi'] - last > 0.5):
        cur = {'t': r['asgi'], 'asgi': [], 'arrive': [], 'add': [], 'steps': []}; bursts.append(cur)
    if cur is None: continue
    if 'asgi' in r: cur['asgi'].append(r['asgi']); last = r['asgi']
    elif 'arrive' in r: cur['arrive'].append(r['arrive'])
    elif 'add' in r: cur['add'].append(r['add'])
    elif r.get('tokens', 0) > 64 and len(cur['steps']) < 4: cur['steps'].append(r)
for i, b in enumerate(bursts):
    t0 = b['t']; ms = lambda xs: [round((x - t0) * 1e3, 1) for x in xs]
    print(f"burst {i}: asgi {len(b['asgi'])} in {ms(b['asgi'])[-1] if b['asgi'] else '-'} ms; generate() {ms(b['arrive'])[:1]}..{ms(b['arrive'])[-1:]}; engine adds {ms(b['add'])[:1]}..{ms(b['add'])[-1:]}")
    for s in b['steps']:
        print(f"    step at {round((s['t0']-t0)*1e3,1):7.1f} ms: {s['ms']:6.1f} ms, {s['tokens']} tokens, {s['seqs']} seqs, {s['waiting_before']} waiting, {s['running_before']} running, firsts {s['firsts']}")

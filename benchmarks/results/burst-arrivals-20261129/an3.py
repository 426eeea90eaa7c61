import json,sys
rows=[json.loads(l) for l in open(sys.argv[1]).read().replace('\0','').splitlines() if l.strip()]
# skip the 2 warmups: start at the 3rd arrive
arr=[i for i,r in enumerate(rows) if 'arrive' in r]
rows=rows[arr[2]:]
t0=rows[0]['arrive']
prev=None
for r in rows:
    k='arrive' if 'arrive' in r else 'asgi' if 'asgi' in r else 'add' if 'add' in r else 'step'
    if k=='step':
        if not r['tokens']: continue
        if r['tokens']==32 and prev=='dec': continue
        prev='dec' if r['tokens']==32 else None
        print(f"{(r['t0']-t0)*1e3:7.1f} step ms={r['ms']:6.1f} tok={r['tokens']:5d} seqs={r['seqs']:3d} wait={r['waiting_before']:3d} run={r['running_before']:3d} firsts={r['firsts']}")
    else:
        print(f"{(r[k]-t0)*1e3:7.1f} {k}")

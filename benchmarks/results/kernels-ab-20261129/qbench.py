import time, torch
from kubeinfer.kernels import ops_cpu
from kubeinfer.kernels.cpu import int8_linear_cpu as L
ops_cpu.start_building()
while ops_cpu.any_kernel_building(): time.sleep(0.2)
torch.manual_seed(0)
out=[]
for m,k in [(2048,576),(2048,1536),(128,1536),(32,576),(32,1536)]:
    x=torch.randn(m,k).bfloat16()
    for _ in range(3): L.quantize_rows(x, None)
    n=max(20, 40000000//(m*k))
    best=1e9
    for rep in range(7):
        t=time.perf_counter()
        for _ in range(n): L.quantize_rows(x, None)
        best=min(best,(time.perf_counter()-t)/n)
    out.append(f"{m}x{k}:{best*1e6:.1f}us")
print(" ".join(out))

"""SmolLM2's tied lm_head shape [49152, 576]: oneDNN's bf16 GEMM against the GGUF Q8_0 tile kernel
(kernels/cpu/quant_linear_cpu.c) on the same random weights, hot and after a 400 MB read (cold)."""
import torch, time
from kubeinfer.kernels import ops_cpu
ops_cpu.start_building()
while ops_cpu.any_kernel_building(): time.sleep(0.2)
from gguf import quants, GGMLQuantizationType as Q
torch.manual_seed(0)
W=torch.randn(49152,576)*0.05
blocks=quants.quantize(W.numpy(), Q.Q8_0)
b=torch.from_numpy(blocks).view(49152, 576//32, 34)
tiles=ops_cpu.gguf_pack("Q8_0", b)
Wb=W.bfloat16()
def best(f,n=30):
    for _ in range(3): f()
    r=1e9
    for _ in range(5):
        t=time.perf_counter()
        for _ in range(n): f()
        r=min(r,(time.perf_counter()-t)/n)
    return r*1e3
for m in (1,8,32,64):
    x=torch.randn(m,576).bfloat16()
    print(m, "bf16", round(best(lambda: torch.nn.functional.linear(x,Wb)),2), "q8_0", round(best(lambda: ops_cpu.gguf_linear(x,tiles)),2), "faster?", ops_cpu.gguf_kernel_is_faster(m))
big=torch.empty(400<<20,dtype=torch.uint8); big.fill_(1)
x=torch.randn(32,576).bfloat16()
def cold(f):
    ts=[]
    for _ in range(8):
        big.view(torch.int32).max(); t=time.perf_counter(); f(); ts.append(time.perf_counter()-t)
    return round(sorted(ts)[len(ts)//2]*1e3,2)
print("cold 32: bf16", cold(lambda: torch.nn.functional.linear(x,Wb)), "q8_0", cold(lambda: ops_cpu.gguf_linear(x,tiles)))

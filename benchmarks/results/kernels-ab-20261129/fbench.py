import time, torch, sys
from kubeinfer.kernels import ops_cpu
from kubeinfer.kernels.cpu import fused_cpu as F
ops_cpu.start_building()
while ops_cpu.any_kernel_building(): time.sleep(0.2)
torch.manual_seed(0)
def best(f, n):
    for _ in range(3): f()
    b=1e9
    for _ in range(7):
        t=time.perf_counter()
        for _ in range(n): f()
        b=min(b,(time.perf_counter()-t)/n)
    return b*1e6
out=[]
for m in (2048, 32):
    x=torch.randn(m,576).bfloat16(); res=torch.randn(m,576).bfloat16(); w=torch.randn(576).bfloat16()
    n=40 if m==2048 else 2000
    out.append(f"norm{m}:{best(lambda: F.rms_norm(x,w,1e-5,res), n):.1f}")
    qkv=torch.randn(m,960).bfloat16(); q=qkv[:, :576].view(m,9,64); k=qkv[:,576:768].view(m,3,64)
    cos=torch.randn(m,64).bfloat16(); sin=torch.randn(m,64).bfloat16()
    out.append(f"rot{m}:{best(lambda: (F.rotate_in_place(q,cos,sin), F.rotate_in_place(k,cos,sin)), n):.1f}")
print(" ".join(out))
rot=F._functions(torch.bfloat16)[2]; norm=F._functions(torch.bfloat16)[0]
out=[]
for m in (2048,32):
    qkv=torch.randn(m,960).bfloat16(); ang=torch.rand(m,64)*6.28; cos=ang.cos().bfloat16(); sin=ang.sin().bfloat16(); sin[:, :32]*=-1
    n=40 if m==2048 else 2000
    out.append(f"rawrot{m}:{best(lambda: rot(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), m, 960, 12, 64), n):.1f}")
    x=torch.randn(m,576).bfloat16(); res=torch.randn(m,576).bfloat16(); w=torch.randn(576).bfloat16(); o=torch.empty_like(x); s=torch.empty_like(x)
    out.append(f"rawnorm{m}:{best(lambda: norm(x.data_ptr(), res.data_ptr(), s.data_ptr(), w.data_ptr(), o.data_ptr(), m, 576, 1e-5), n):.1f}")
print(" ".join(out))

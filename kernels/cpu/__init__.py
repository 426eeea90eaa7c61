"""Plain-C CPU kernels (`*.c`, `*.h`), their build (`cpu_build`) and the ctypes wrappers that call them."""

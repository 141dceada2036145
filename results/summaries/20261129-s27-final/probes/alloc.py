import time, numpy as np, mlx.core as mx, sys
mx.eval(mx.zeros((4,)) + 1)
shape=(1,2,4352,32); m = sys.argv[1]
t0=time.perf_counter()
if m == "zeros": z=[mx.zeros(shape, mx.float32) for _ in range(4)]; mx.eval(z)
elif m == "fromnp": z=[mx.array(np.empty(shape, np.float32)) for _ in range(4)]; mx.eval(z)
elif m == "onebig": z=mx.zeros((4,)+shape, mx.float32); mx.eval(z)
elif m == "npfill": z=[np.empty(shape, np.float32) for _ in range(4)]; [a.fill(0) for a in z]
t1=time.perf_counter()
print(m, "%.2f ms" % ((t1-t0)*1e3))

# The PyTorch DDP (gloo, CPU) baseline for `train --bench`: the same MLP, data, per-rank batch,
# optimizer and sampler, timed the same way (20 warm-up steps, then the slowest rank's time).
#
#   apt-get install python3-torch python3-numpy libopenblas0-openmp dataset-fashion-mnist
#   LD_LIBRARY_PATH=/usr/lib/x86_64-linux-gnu/openblas-openmp python3 torch_ddp_baseline.py W STEPS [THREADS]
import gzip, os, sys, time
import numpy as np
import torch, torch.distributed as dist, torch.multiprocessing as mp
from torch import nn

D = "/usr/share/datasets/fashion-mnist"
def idx(name):
    with gzip.open(os.path.join(D, name)) as f:
        b = f.read()
    nd = b[3]; dims = [int.from_bytes(b[4+4*i:8+4*i], "big") for i in range(nd)]
    return np.frombuffer(b, np.uint8, offset=4+4*nd).reshape(dims)

def worker(rank, world, steps, warm, threads, port):
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x = torch.from_numpy(idx("train-images-idx3-ubyte.gz").reshape(-1, 784).astype(np.float32) / 255)
    y = torch.from_numpy(idx("train-labels-idx1-ubyte.gz").astype(np.int64))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 10))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    sampler = torch.utils.data.DistributedSampler(range(len(y)), world, rank, seed=0)
    ind = torch.tensor(list(iter(sampler)))
    B = 64; nb = len(ind) // B
    lossf = nn.CrossEntropyLoss()
    def step(i):
        b = ind[(i % nb) * B:(i % nb + 1) * B]
        opt.zero_grad(); loss = lossf(ddp(x[b]), y[b]); loss.backward(); opt.step()
    for i in range(warm): step(i)
    dist.barrier(); t = time.perf_counter()
    for i in range(steps): step(warm + i)
    dist.barrier(); t = torch.tensor([time.perf_counter() - t], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"torch {torch.__version__} gloo  world {world}  threads {threads}  step_ms {t.item()*1e3/steps:.3f}  samples/s {world*B*steps/t.item():.0f}", flush=True)
    dist.destroy_process_group()

if __name__ == "__main__":
    world, steps, threads = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 1
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(world, steps, 20, threads, port), nprocs=world)

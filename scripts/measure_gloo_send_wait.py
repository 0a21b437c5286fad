"""Does torch.distributed.send over gloo (vLLM 0.5.3's send_object: a size tensor, then the pickled
metadata, on the CPU group) return before the receiver has posted its recv? The receiver posts 200 ms late."""
import os, time, torch, torch.distributed as dist, torch.multiprocessing as mp
def run(rank, n):
    os.environ["MASTER_ADDR"] = "127.0.0.1"; os.environ["MASTER_PORT"] = "29571"
    dist.init_process_group("gloo", rank=rank, world_size=2)
    for size in (4, 65536, 16 << 20):
        t = torch.zeros(size // 4)
        dist.barrier()
        if rank == 0:
            t0 = time.perf_counter(); dist.send(t, 1); dt = time.perf_counter() - t0
            print(f"{size:>9d} B: send returned after {dt*1e3:.1f} ms (receiver posts at 200 ms)", flush=True)
        else:
            time.sleep(0.2); dist.recv(t, 0)
    dist.destroy_process_group()
if __name__ == "__main__":
    mp.spawn(run, args=(2,), nprocs=2)

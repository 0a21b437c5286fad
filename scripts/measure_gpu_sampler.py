"""Check the GPU sampling prices of engine/pricing/sampling_ops.py on a real GPU (waits for a device).

Runs, with torch on `--device`, the kernel sequence sampling_ops.sampler_kernels lists for each
setting (this project's own rendering of vLLM's sampler steps: temperature divide, penalties,
full-vocabulary sort with top-k / top-p masks, softmax and log-softmax, greedy argmax or the
exponential draw) over [rows, vocab] logits in fp16, times each setting with CUDA events (median
of `--repeats` after warm-up), and prints it beside the priced kernels of `--hardware`:

    python scripts/measure_gpu_sampler.py --hardware h100-80g --out /tmp/gpu_sampler.json

What to compare: the priced extra over the reference path (temperature 1, nothing else) against
the measured one; the reference path itself is priced by the host tables' fit, not here.
`--device cpu` runs the same code as a smoke test (its times mean nothing for a GPU).
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

SETTINGS = {
    "reference": {},
    "greedy": {"temperature": 0.0},
    "top_p_top_k": {"temperature": 0.8, "top_k": 50, "top_p": 0.95},
    "penalties": {"temperature": 0.8, "repetition_penalty": 1.1, "presence_penalty": 0.1, "frequency_penalty": 0.1},
    "all": {"temperature": 0.8, "top_k": 50, "top_p": 0.95, "repetition_penalty": 1.1, "presence_penalty": 0.1,
            "frequency_penalty": 0.1},
}


def step(torch, logits, s, prompt, output):
    """One sampler call: the steps sampling_ops prices, in vLLM's order."""
    rows, vocab = logits.shape
    x = logits.clone()
    if s.penalties:
        def counts(tokens):
            c = torch.zeros((rows, vocab + 1), dtype=torch.long, device=x.device)
            c.scatter_add_(1, tokens, torch.ones_like(tokens))
            return c[:, :vocab], c[:, :vocab] > 0
        _, pmask = counts(prompt)
        ocounts, omask = counts(output)
        rep = torch.full((rows, 1), s.repetition_penalty, dtype=x.dtype, device=x.device).repeat(1, vocab)
        rep[~(pmask | omask)] = 1.0
        x = torch.where(x > 0, x / rep, x * rep)
        x -= s.frequency_penalty * ocounts
        x -= s.presence_penalty * omask
    x.div_(max(s.temperature, 1e-5) if s.temperature else 1.0)
    if s.top_k_top_p:
        srt, idx = x.sort(dim=-1)
        k = s.top_k or vocab
        srt.masked_fill_(srt < srt[:, vocab - k:vocab - k + 1], -float("inf"))
        cum = srt.softmax(dim=-1).cumsum(dim=-1)
        mask = cum <= 1 - s.top_p
        mask[:, -1] = False
        srt.masked_fill_(mask, -float("inf"))
        inv = torch.empty_like(idx).scatter_(1, idx, torch.arange(vocab, device=x.device).expand_as(idx))
        x = torch.gather(srt, 1, inv)
    probs = torch.softmax(x, dim=-1, dtype=torch.float)
    logprobs = torch.log_softmax(x, dim=-1, dtype=torch.float)
    if s.greedy:
        return logprobs[torch.arange(rows, device=x.device)].argmax(dim=-1)
    p = probs[torch.arange(rows, device=x.device)]
    return p.div_(torch.empty_like(p).exponential_()).argmax(dim=-1)


def main() -> int:
    import torch

    from engine.pricing.hardware import get_hardware
    from engine.pricing.kernels import KernelCoefficients
    from engine.pricing.sampling_ops import SamplerSettings, kernels_s

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--hardware", default="h100-80g")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--rows", default="32,256,512")
    ap.add_argument("--vocabs", default="32000,128256")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = torch.device(args.device)
    hw = get_hardware(args.hardware)
    kc = KernelCoefficients.from_mapping(hw.kernels) if hw.kernels else KernelCoefficients()
    points = []
    for vocab in (int(v) for v in args.vocabs.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            gen = torch.Generator(device=dev).manual_seed(0)
            logits = torch.randn(rows, vocab, generator=gen, device=dev).to(torch.float16)
            prompt = torch.randint(0, vocab, (rows, 512), generator=gen, device=dev)
            output = torch.randint(0, vocab, (rows, 128), generator=gen, device=dev)
            for name, values in SETTINGS.items():
                s = SamplerSettings(**values)
                times = []
                for i in range(args.repeats + 3):
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    step(torch, logits, s, prompt, output)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    if i >= 3:
                        times.append(time.perf_counter() - t0)
                priced = kernels_s(s, rows, vocab, 2, hw.mem_bw_Bps, kc.add_efficiency, kc.norm_efficiency,
                                   kc.elementwise_floor_s)
                points.append({"setting": name, "rows": rows, "vocab": vocab, "measured_s": statistics.median(times),
                               "priced_kernels_s": priced})
                print(f"{name:12s} {rows:4d} x {vocab:6d}: measured {points[-1]['measured_s'] * 1e3:7.3f} ms, "
                      f"priced kernels {priced * 1e3:7.3f} ms")
    if args.out:
        args.out.write_text(json.dumps({"device": str(torch.cuda.get_device_name(0)) if dev.type == "cuda" else "cpu",
                                        "torch": torch.__version__, "hardware": args.hardware, "points": points},
                                       indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

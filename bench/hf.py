"""A Hugging Face transformers MoE model trained as its users train it: eager, torch.compile, boundpass, side by side.

One model (MixtralForCausalLM from its config class: 2 layers, H = 256, 8 experts, top-2, V = 32,768; fp32;
HF's default grouped_mm experts, sdpa attention) and one training step ``model(input_ids=x, labels=y).loss
.backward()`` (no optimizer: the step's device peak is what differs) at N = 4,096 / 8,192 / 16,384 tokens (one
sequence), under:

  eager           the model itself
  torch.compile   torch.compile(model) (Inductor)
  boundpass       boundpass.compile(model, budget=...) with its default kernels (aot_eager): the head rewritten to
                  Ring-DTP (logits None in training) and every experts layer to PipelinedLLEP
  boundpass+ind   the same with inner="inductor"

Peak: the whole step at torch's CPU allocator (boundpass.testing.whole_step.allocator_step_peak: parameters,
gradients, every activation and every kernel temporary), the second step of each schedule (the first compiles).
Time: median wall seconds of the steps, the schedules timed round-robin (bench/common.interleaved_medians).
boundpass's certified peak beside its measured one. Writes docs/results/hf.json and hf.md.

    python bench/hf.py [--quick]
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable for `bench.*`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch

import boundpass
from bench.common import fmt_bytes, fmt_seconds, interleaved_medians, markdown_table, publish, run_metadata
from boundpass.testing.whole_step import allocator_step_peak

warnings.filterwarnings("ignore", category=FutureWarning)
SHAPE = dict(vocab_size=32_768, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2)
FULL = dict(tokens=(4_096, 8_192, 16_384), repeats=3)
QUICK = dict(tokens=(1_024, 2_048), repeats=2)
BUDGET = "16GiB"
SCHEDULES = ("eager", "torch.compile", "boundpass", "boundpass+ind")


def _model(transformers):
    torch.manual_seed(0)
    config = transformers.MixtralConfig(use_cache=False, eos_token_id=None, pad_token_id=None, bos_token_id=None,
                                        max_position_embeddings=32_768, **SHAPE)
    return transformers.MixtralForCausalLM(config)


def _schedule(name: str, model):
    """(the step: batch -> (loss, output), the compiled object or None)."""
    if name == "eager":
        fn = model
    elif name == "torch.compile":
        fn = torch.compile(model)
    else:
        fn = boundpass.compile(model, budget=BUDGET, inner="inductor" if name == "boundpass+ind" else "aot_eager")

    def step(tokens, labels):
        out = fn(input_ids=tokens, labels=labels)
        return out.loss, out
    return step, (fn if name.startswith("boundpass") else None)


def measure(n: int, repeats: int) -> dict:
    import transformers
    g = torch.Generator().manual_seed(n)
    batches = [(torch.randint(0, SHAPE["vocab_size"], (1, n), generator=g),
                torch.randint(0, SHAPE["vocab_size"], (1, n), generator=g)) for _ in range(2)]
    rows, steps = {}, {}
    torch._dynamo.reset()
    for name in SCHEDULES:  # no reset between them: the timing below calls every schedule's compiled code again
        model = _model(transformers)
        step, compiled = _schedule(name, model)
        start = time.perf_counter()
        peak = allocator_step_peak(step, model, None, batches)  # step 1 compiles (unmeasured), step 2 measured
        row = {"peak_bytes": peak, "first_two_steps_s": time.perf_counter() - start}
        if compiled is not None:
            report = boundpass.explain(compiled)
            row["certified_bytes"] = compiled.certificates[-1].table.total
            row["rewritten"] = [f"{r.kind} {r.module_path}" for r in report.matched]
        rows[name] = row

        def timed(step=step, model=model, batch=batches[0]):
            step(*batch)[0].backward()
            model.zero_grad(set_to_none=True)
        steps[name] = timed
        print(f"N = {n:,} {name}: peak {fmt_bytes(peak)}"
              + (f", certified {fmt_bytes(row['certified_bytes'])}" if compiled is not None else ""), flush=True)
    for name, seconds in interleaved_medians(steps, repeats=repeats, warmup=0).items():
        rows[name]["step_s"] = seconds
    return rows


def render(data: dict) -> str:
    lines = ["# Hugging Face MoE model: eager, torch.compile and boundpass side by side", "",
             f"MixtralForCausalLM {data['shape']}, fp32, one sequence of N tokens, `model(input_ids, labels=labels)`"
             f" + backward; boundpass at budget {data['budget']}. Peak: the whole step at torch's CPU allocator "
             "(parameters, gradients, activations, kernel temporaries), measured. Time: median of "
             f"{data['repeats']} steps, round-robin. Run {data['meta']['date_utc']}, {data['meta']['nproc']} cores.", ""]
    headers = ["N", "schedule", "peak (measured)", "vs eager", "certified", "step", "vs eager"]
    table = []
    for n, rows in data["tokens"].items():
        eager = rows["eager"]
        for name in SCHEDULES:
            r = rows[name]
            table.append([f"{int(n):,}", name, fmt_bytes(r["peak_bytes"]), f"{r['peak_bytes'] / eager['peak_bytes']:.2f}x",
                          fmt_bytes(r.get("certified_bytes")), fmt_seconds(r["step_s"]),
                          f"{r['step_s'] / eager['step_s']:.2f}x"])
    lines += [markdown_table(headers, table), ""]
    first = next(iter(data["tokens"].values()))
    lines += ["Rewritten by boundpass: " + ", ".join(first["boundpass"]["rewritten"]) + ".", ""]
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small N, 2 repeats (a smoke run)")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else FULL
    started = time.perf_counter()
    data = {"meta": run_metadata(), "shape": SHAPE, "budget": BUDGET, "repeats": sizes["repeats"],
            "tokens": {str(n): measure(n, sizes["repeats"]) for n in sizes["tokens"]}}
    publish("hf_quick" if args.quick else "hf", data, render, started)


if __name__ == "__main__":
    main()

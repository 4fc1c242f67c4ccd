"""How many of boundpass's modules one compile walks through, and how often it crosses between them.

One ``boundpass.compile`` of a small plain-PyTorch MoE LM (boundpass.testing.mixtral_lm: the vocab and the dispatch
pass both rewrite it), its first step (capture, passes, partition, planning, lowering) and backward, traced with
``sys.setprofile``: every Python call from a function of one boundpass module into a function of another is a
crossing. Reported: the modules entered, the distinct module -> module edges, the crossings in call order, and
how many of them re-enter the module that holds ``boundpass.compile`` (the hub, when there is one).

    .venv/bin/python bench/walk.py            # the table
    .venv/bin/python bench/walk.py --json F   # also the numbers, as JSON

It reads nothing of the layout, so the same script measures any commit (git worktree add /tmp/old <rev>; run it
there with PYTHONPATH=/tmp/old).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import Counter


def _module_of(frame) -> str:
    return frame.f_globals.get("__name__", "")


def walk() -> dict:
    import torch

    import boundpass
    from boundpass.testing.mixtral_lm import MixtralLM

    torch.manual_seed(0)
    model = MixtralLM(vocab=512, hidden=32, inter=64, experts=4, top_k=2, checkpointed=True)
    tokens = torch.randint(0, 512, (2, 64))
    labels = torch.randint(0, 512, (2 * 64,))

    def loss_fn(logits, y):
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y)

    hub = boundpass.compile.__module__
    edges: Counter = Counter()
    entered: set = set()
    order: list = []

    def profile(frame, event, arg):
        if event != "call":
            return
        callee = _module_of(frame)
        if not callee.startswith("boundpass"):
            return
        entered.add(callee)
        caller = frame.f_back
        while caller is not None and not _module_of(caller).startswith("boundpass"):
            caller = caller.f_back  # through torch's frames (Dynamo, AOTAutograd) to the boundpass code that called
        if caller is None:
            return
        src = _module_of(caller)
        if src != callee:
            edges[(src, callee)] += 1
            order.append((src, callee))

    compiled = boundpass.compile(model, loss_fn=loss_fn, budget="4GiB")
    sys.setprofile(profile)
    try:
        compiled(tokens, labels).backward()
    finally:
        sys.setprofile(None)
    report = boundpass.explain(compiled)
    rewritten = [r.kind for r in report.regions if r.rewritten]
    return {"hub": hub, "modules": sorted(entered), "edges": len(edges),
            "crossings": len(order), "into_hub": sum(n for (a, b), n in edges.items() if b == hub),
            "edges_into_hub": sum(1 for (a, b) in edges if b == hub),
            "edges_of_hub": sum(1 for (a, b) in edges if hub in (a, b)),
            "edge_list": sorted(f"{a} -> {b} ({n})" for (a, b), n in edges.items()),
            "rewritten": rewritten}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args(argv)
    out = walk()
    print(f"modules entered             : {len(out['modules'])}")
    print(f"module -> module edges      : {out['edges']} ({out['edges_of_hub']} from or into {out['hub']})")
    print(f"crossings (calls, in order) : {out['crossings']} ({out['into_hub']} into {out['hub']})")
    print(f"regions rewritten           : {', '.join(out['rewritten'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()

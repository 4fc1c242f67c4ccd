"""explain shows the step's peak: the program point and its largest tensors, the predicted timeline over the
step (max = the certified device peak), and plot() of predicted vs measured live bytes, uncompiled beside
boundpass. A plain PyTorch LM (not torchtitan's), aot_eager, AdamW kept on the device."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import boundpass
from boundpass.planning.explain import ExplainReport
from boundpass.measure.memtrack import LiveStorageTracker
from boundpass.testing.whole_step import measured_step_peak, measured_step_timeline

pytest.importorskip("matplotlib")

V, H, F_, B, L = 2048, 64, 512, 2, 128


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, H)
        self.up = nn.Linear(H, F_)
        self.down = nn.Linear(F_, H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, tokens):
        return self.head(self.down(F.gelu(self.up(self.emb(tokens)))))


def loss_fn(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, V, (B, L), generator=g), torch.randint(0, V, (B, L), generator=g)) for _ in range(n)]


@pytest.fixture(scope="module")
def compiled():
    torch.manual_seed(0)
    model = TinyLM()
    step = boundpass.compile(model, budget="2GiB", loss_fn=loss_fn, optimizer=torch.optim.AdamW(model.parameters()))
    tokens, labels = _batches(1)[0]
    step(tokens, labels).backward()   # the first call captures, rewrites, certifies
    step.optimizer.zero_grad(set_to_none=True)
    return model, step, boundpass.explain(step)


def test_text_has_step_peak_section(compiled):
    _, _, report = compiled
    cert = report.certificate
    text = report.text(graph="none")
    assert "step peak (predicted, device bytes per rank):" in text
    section = text.split("step peak (predicted")[1]
    assert f"peak at {cert.point.phase} node {cert.point.node}" in section
    rows = [ln for ln in section.splitlines() if ln.rstrip().endswith("<- peak")]
    assert len(rows) == 1 and rows[0].startswith("> ")
    assert "optimizer" in section.splitlines()[-1]
    timeline = section.split("timeline:")[1].splitlines()[1:]
    assert 20 <= len(timeline) <= 22 and all(len(ln) <= 100 for ln in timeline)   # a 100-column terminal
    assert len(section.splitlines()) <= 40   # compact: ~20 sampled rows + the peak's contributors


def test_report_fits_120_columns_and_lists_boundpass_ops_with_knobs(compiled):
    """The default report (str, text()) and text(formulas=True) fit a 120-column terminal; the graph excerpt is
    one row per boundpass op of the partitioned graphs: phase, op, module path, its non-tensor arguments."""
    _, _, report = compiled
    for text in (str(report), report.text(), report.text(formulas=True), report.text(graph="none")):
        assert max(len(ln) for ln in text.splitlines()) <= 120
    assert str(report) == report.text(graph="excerpt")
    (region,) = report.rewritten_of("vocab")
    section = report.text().split("boundpass ops (phase, op, module, arguments other than tensors):")[1]
    rows = [ln.split() for ln in section.strip().splitlines()]
    assert [r[:3] for r in rows] == [["forward", "ring_dtp_fwd", "model.head"], ["backward", "ring_dtp_bwd", "model.head"]]
    assert all(f"block={region.block}" in r and f"vocab_size={V}" in r for r in rows)
    assert "Theta*b" in report.text(formulas=True) and "Theta*b" not in report.text()   # formulas are opt-in
    assert report.graph_code and report.graph_code in report.text(graph="full")


def test_timeline_max_is_certified_peak(compiled):
    _, _, report = compiled
    cert, table = report.certificate, report.table
    line = report.timeline()
    assert len(line) == len(cert.peak.points) + 1
    assert line[-1][:2] == ("optimizer", "step")
    assert line[-1][3] == table.sum("persistent") + table.sum("step")
    assert {ph for ph, *_ in line[:-1]} == {"forward", "backward"}
    assert max(b for *_, b in line) == table.total
    peak_row = line[cert.point.index]
    assert peak_row[1] == cert.point.node
    assert peak_row[3] == table.sum("persistent") + cert.graph_bytes
    assert all(b >= table.sum("persistent") for *_, b in line)


def test_no_certificate_no_timeline():
    report = ExplainReport(budget=1 << 30)
    assert report.timeline() == []
    assert "step peak" not in report.text(graph="none")


def test_measured_timeline_max_is_measured_peak(compiled):
    model, step, report = compiled
    batches = _batches(2, seed=1)
    peak = measured_step_peak(step, model, step.optimizer, batches)
    samples = measured_step_timeline(step, model, step.optimizer, batches)
    assert len(samples) > 10
    assert abs(max(samples) - peak) <= 64
    assert peak <= report.table.total <= 1.10 * peak   # the certified peak against the measured one


def test_tracker_records_only_when_asked():
    with LiveStorageTracker() as off:
        torch.ones(1024) * 2
    assert off.samples == [] and off.peak_bytes() == 8192
    with LiveStorageTracker(record=True) as on:
        a = torch.ones(1024)
        b = a * 2
        a.mul_(3)              # in place: allocates nothing, no sample
        del a, b
        torch.zeros(256)
    assert on.samples == [4096, 8192, 1024]
    assert max(on.samples) == on.peak_bytes()


def _png(path) -> bool:
    return path.exists() and path.stat().st_size > 1000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_png(compiled, tmp_path):
    model, step, report = compiled
    assert report.plot(tmp_path / "alone.png") == tmp_path / "alone.png"
    assert _png(tmp_path / "alone.png")

    measured = measured_step_timeline(step, model, step.optimizer, _batches(2, seed=2))
    eager_model = TinyLM()
    eager_opt = torch.optim.AdamW(eager_model.parameters())
    eager = measured_step_timeline(lambda x, y: loss_fn(eager_model(x), y), eager_model, eager_opt, _batches(2))
    report.plot(tmp_path / "measured.png", measured=measured)
    report.plot(tmp_path / "side.png", measured=measured, reference=(None, eager))
    report.plot(tmp_path / "two_reports.png", measured=measured, reference=report)
    for name in ("measured.png", "side.png", "two_reports.png"):
        assert _png(tmp_path / name), name
    # two panels are wider than one
    from PIL import Image
    assert Image.open(tmp_path / "side.png").size[0] > 1.5 * Image.open(tmp_path / "measured.png").size[0]

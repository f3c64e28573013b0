"""The README's main job on the bundled default model: `deepinfer-sg extract` with no extra flags gives one
schema-valid record per input line (jsonschema as the oracle) and ends with a one-line summary; the default
model carries a Zipf unigram prior over token ids (checked against the ids with a rank correlation)."""
import json
from pathlib import Path

import jsonschema
import numpy as np
import torch
from scipy import stats

from deepinfer_sg import cli

DATA = Path(__file__).resolve().parents[2] / "deepinfer_sg" / "data"


def test_readme_extract_job_gives_valid_records(default_llm, monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(cli, "_make_llm", lambda args: default_llm)
    lines = (DATA / "invoices.jsonl").read_text().splitlines()[:2]       # a subset: tests stay fast
    inp, out = tmp_path / "invoices.jsonl", tmp_path / "out" / "invoices.jsonl"
    inp.write_text("\n".join(lines) + "\n")
    schema_path = DATA / "invoice_schema.json"
    assert cli.main(["extract", "--schema", str(schema_path), "--input", str(inp), "--output", str(out),
                     "--no-progress"]) == 0
    schema = json.loads(schema_path.read_text())
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["id"] for r in records] == [json.loads(x)["id"] for x in lines]
    for r in records:
        assert "output" in r, r                     # the default budget lets the default model finish
        jsonschema.validate(r["output"], schema)
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert summary.startswith("extract: 2 records (2 valid, 0 errors)"), summary
    assert "tokens/s" in summary and "elapsed" in summary


def test_extract_defaults_depend_on_the_model():
    p = cli.build_parser()
    bundled = p.parse_args(["extract", "--schema", "s.json", "--input", "i", "--output", "o"])
    real = p.parse_args(["extract", "--schema", "s.json", "--input", "i", "--output", "o", "--model", "/ckpt"])
    cli._extract_defaults(bundled)
    cli._extract_defaults(real)
    assert bundled.temperature == 1.0 and real.temperature == 0.0       # random weights: sample; real: greedy
    assert bundled.max_tokens == real.max_tokens == cli.EXTRACT_MAX_TOKENS
    explicit = p.parse_args(["extract", "--schema", "s", "--input", "i", "--output", "o", "--temperature", "0"])
    cli._extract_defaults(explicit)
    assert explicit.temperature == 0.0


def test_default_model_has_a_zipf_prior_over_token_ids(default_llm):
    """Averaged over contexts, the default model's logits fall with ln(1 + id): strongly rank-correlated
    (random output weights alone would give a correlation near 0)."""
    model = default_llm.model
    g = torch.Generator().manual_seed(0)
    V = model.head.weight.shape[0]
    ids = torch.randint(3, V, (2, 16), generator=g)
    with torch.no_grad():
        mean_logits = model.forward_logits(ids).float().mean((0, 1))
    sample = torch.randint(0, V, (4000,), generator=g)
    rho = stats.spearmanr(sample.numpy(), mean_logits[sample].numpy()).statistic
    assert rho < -0.9, rho
    # the slope of that fall is the configured exponent (within the calibration's spread)
    fit = np.polyfit(np.log1p(sample.numpy().astype(np.float64)), mean_logits[sample].double().numpy(), 1)
    from deepinfer_sg.engine.default_model import UNIGRAM_ALPHA
    assert abs(-fit[0] - UNIGRAM_ALPHA) < 0.25 * UNIGRAM_ALPHA, fit

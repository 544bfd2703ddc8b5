"""``make bench-compare``: a ratio that got worse beyond the measured run-to-run spread fails.

The baseline is what ``bench/results/results.json`` holds after two runs (each ratio with its
value and its spread); the current document is one new run (``run.json``: plain values).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench program is not installed

from bench.compare import compare, main, ratios


def _cell(value: float | None, spread: float | None) -> dict[str, Any]:
    return {"value": value, "runs": [], "spread": spread}


BASELINE = {
    "schema": 2,
    "headline": {
        "interleaved": {
            "modeld_over_limit": _cell(1.04, 0.10),  # two runs 10% apart
            "modeld_over_llama_server": _cell(0.95, 0.02),  # two runs 2% apart: the 5% floor applies
            "decode_over_limit": _cell(1.00, 0.01),
            "http_overhead_ms": _cell(3.0, 1.0),
            "modeld_over_lcp_server": _cell(None, None),  # lcp-server did not run in the baseline
        }
    },
}


def _run(**values: float | None) -> dict[str, Any]:
    return {"schema": 2, "headline": {"interleaved": dict(values)}}


def _verdicts(current: dict[str, Any]) -> dict[str, str]:
    return {f.ratio: f.verdict for f in compare(BASELINE, current)}


def test_a_run_inside_every_spread_passes() -> None:
    current = _run(
        modeld_over_limit=1.13,  # +8.7%: inside the measured 10%
        modeld_over_llama_server=0.99,  # +4.2%: inside the 5% floor
        decode_over_limit=0.96,  # -4%: inside the floor
        http_overhead_ms=4.9,  # +1.9 ms: inside the 2 ms floor
        modeld_over_lcp_server=0.8,
    )
    assert _verdicts(current) == {
        "modeld_over_limit": "ok",
        "modeld_over_llama_server": "ok",
        "decode_over_limit": "ok",
        "http_overhead_ms": "ok",
        "modeld_over_lcp_server": "not measured",
    }


def test_each_kind_of_regression_is_flagged_in_its_own_direction() -> None:
    current = _run(
        modeld_over_limit=1.15,  # +10.6%: beyond the measured 10% (TTFT ratios: up is worse)
        modeld_over_llama_server=0.90,  # down: better, never flagged
        decode_over_limit=0.94,  # -6%: beyond the 5% floor (decode speed: down is worse)
        http_overhead_ms=5.5,  # +2.5 ms: beyond 2 ms
    )
    findings = {f.ratio: f for f in compare(BASELINE, current)}
    assert {k: f.verdict for k, f in findings.items()} == {
        "modeld_over_limit": "worse",
        "modeld_over_llama_server": "better",
        "decode_over_limit": "worse",
        "http_overhead_ms": "worse",
    }  # modeld_over_lcp_server: measured on neither side, not listed
    assert findings["modeld_over_limit"].tolerance == 0.10
    assert findings["modeld_over_llama_server"].tolerance == 0.05
    assert findings["http_overhead_ms"].tolerance == 2.0


def test_the_current_documents_own_spread_widens_the_tolerance() -> None:
    merged = {"headline": {"interleaved": {"modeld_over_llama_server": _cell(1.02, 0.09)}}}
    assert _verdicts(merged)["modeld_over_llama_server"] == "ok"  # +7.4% against a 9% spread
    assert ratios(merged) == {("interleaved", "modeld_over_llama_server"): (1.02, 0.09)}


def test_the_command_exits_non_zero_on_a_regression_and_zero_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    baseline = tmp_path / "results.json"
    baseline.write_text(json.dumps(BASELINE))
    worse = tmp_path / "worse.json"
    worse.write_text(json.dumps(_run(modeld_over_limit=1.2)))
    same = tmp_path / "same.json"
    same.write_text(json.dumps(_run(modeld_over_limit=1.04, decode_over_limit=1.0)))

    assert main(["--baseline", str(baseline), "--current", str(worse)]) == 1
    out = capsys.readouterr()
    assert "worse        interleaved            modeld_over_limit" in out.out
    assert "1 ratio(s) got worse" in out.err

    assert main(["--baseline", str(baseline), "--current", str(same)]) == 0
    assert "no ratio got worse" in capsys.readouterr().out

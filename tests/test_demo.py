"""`taperfold demo` (behind ./scripts/demo) runs every stage end to end; a short schedule keeps it quick."""

import json

from taperfold.errors import TaperfoldError


def test_demo_runs_every_stage(cli, tmp_path):
    out = tmp_path / "demo"
    result = cli("demo", "-o", out, "--steps", "40")
    assert result.exit_code == 0, result.stderr[-2000:]
    for stage in ("1/6 train", "2/6 inspect", "3/6 export", "4/6 verify", "5/6 bench", "6/6 bench"):
        assert stage in result.stdout
    export = out / "export"
    assert json.loads((export / "verify.json").read_text())["passed"] is True
    manifest = json.loads((export / "manifest.json").read_text())
    assert manifest["gate"] == 0.0  # Internal-Taper: both norms of every layer fold
    assert manifest["artifacts"]["folded"]["reports"]["fold"]["summary"]["folded"] == 2 * manifest["config"]["n_layers"]
    decode = json.loads((export / "bench-decode.json").read_text())
    assert {r["phase"] for r in decode["results"]} == {"prefill", "decode"}
    assert json.loads((export / "bench.json").read_text())["mode"] == "prefill"  # not overwritten by decode
    assert "(bench-decode.json, bench.json, manifest.json, verify.json)" in result.stdout.splitlines()[-1]


def test_a_failed_demo_takes_the_folder_it_made_with_it(cli, tmp_path, monkeypatch):
    import taperfold.export

    def failing_export(*args, **kwargs):
        raise TaperfoldError("the export failed")

    monkeypatch.setattr(taperfold.export, "export_checkpoint", failing_export)
    r = cli("demo", "-o", tmp_path / "demo", "--steps", "30")
    assert r.exit_code == 2 and "the export failed" in r.stderr
    assert not (tmp_path / "demo").exists()

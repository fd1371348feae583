"""The README's main command, in-process: kvfit generate on the bundled model with fp8 KV."""

from __future__ import annotations

from kvfit.cli import main


def test_generate_fp8_chat(capsys):
    rc = main(["generate", "What is the capital of France?", "--chat", "--max-tokens", "12",
               "--kv-dtype", "fp8_e4m3", "--device", "cpu", "--num-tokens", "4096"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Paris" in out


def test_generate_reports_bad_combination(capsys):
    rc = main(["generate", "hi", "--attention-backend", "fi", "--device", "cpu"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "unsupported combination" in err and "backend=fi" in err and "torch" in err

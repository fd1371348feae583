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


def test_generate_runs_no_more_requests_than_prompts(monkeypatch):
    """generate caps max_num_seqs at the prompt count: one prompt = one-token decode steps, so
    --decode-gemv auto resolves on (its fused GEMV on CUDA); an explicit off stays off."""
    import kvfit.cli_generate as cli_generate

    seen = []
    monkeypatch.setattr(cli_generate, "run_generate",
                        lambda cfg, *a, **kw: seen.append(cfg) or 0)
    assert main(["generate", "hi", "--device", "cpu"]) == 0
    assert seen[-1].max_num_seqs == 1 and seen[-1].resolved_decode_gemv
    assert main(["generate", "a", "b", "c", "--max-num-seqs", "2", "--device", "cpu"]) == 0
    assert seen[-1].max_num_seqs == 2 and not seen[-1].resolved_decode_gemv
    assert main(["generate", "hi", "--decode-gemv", "off", "--device", "cpu"]) == 0
    assert seen[-1].max_num_seqs == 1 and not seen[-1].resolved_decode_gemv

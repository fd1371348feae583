"""``models/gguf_readers.shared_gguf_readers``: inside the block every ``gguf.GGUFReader(path)``
(kvfit's and transformers', which looks the name up in ``gguf`` when it runs) is one parse per
file; nested blocks share it; leaving the outermost block restores the library's class and drops
the readers; a rewritten file is parsed again; a damaged file raises and is not cached."""

from __future__ import annotations

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from kvfit.models.gguf_readers import shared_gguf_readers  # noqa: E402


def _write(path, n_tokens: int = 50, seed: int = 0):
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list([f"tok{i}" for i in range(n_tokens)])
    w.add_tensor("token_embd.weight", rng.standard_normal((n_tokens, 8)).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_one_parse_per_file_inside_and_the_class_back_outside(tmp_path, monkeypatch):
    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    _write(a)
    _write(b, seed=1)
    original = gguf.GGUFReader
    parses = []

    class Counting(original):
        def __init__(self, path, mode="r"):
            parses.append(str(path))
            super().__init__(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    with shared_gguf_readers():
        assert gguf.GGUFReader is not Counting
        from gguf import GGUFReader  # as transformers imports it, at call time

        r1 = GGUFReader(str(a))
        with shared_gguf_readers():  # nested: the same readers
            r2 = gguf.GGUFReader(a)  # a Path names the same file
        r3 = GGUFReader(str(b))
        assert r1 is r2 and r3 is not r1 and gguf.GGUFReader is not Counting
        assert bytes(r1.fields["general.architecture"].parts[-1]).decode() == "llama"
        assert len(r1.tensors) == 1 and r1.tensors[0].name == "token_embd.weight"
        assert gguf.GGUFReader(str(a), "r+") is not r1  # a writable mode is never shared
    assert gguf.GGUFReader is Counting
    assert parses == [str(a), str(b), str(a)]
    with shared_gguf_readers():  # a new block parses again (the readers were dropped)
        assert gguf.GGUFReader(str(a)) is not r1
    assert len(parses) == 4


def test_a_rewritten_file_is_parsed_again_and_a_damaged_one_is_not_cached(tmp_path):
    a = tmp_path / "a.gguf"
    _write(a, n_tokens=50)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(a.read_bytes()[:40])  # header cut inside the metadata
    with shared_gguf_readers():
        r1 = gguf.GGUFReader(str(a))
        _write(a, n_tokens=70)  # rewritten: another size
        r2 = gguf.GGUFReader(str(a))
        assert r2 is not r1 and len(r2.fields["tokenizer.ggml.tokens"].data) == 70
        for _ in range(2):
            with pytest.raises(Exception):
                gguf.GGUFReader(str(bad))


def test_a_result_is_built_once_per_file_inside_and_handed_out_as_copies(tmp_path):
    from kvfit.models.gguf_readers import shared_result

    a = tmp_path / "a.gguf"
    _write(a)
    builds = []

    def build():
        builds.append(1)
        return {"layers": [1, 2]}

    first = shared_result(a, "cfg", build)  # outside: built every call
    assert shared_result(a, "cfg", build) == first and len(builds) == 2
    with shared_gguf_readers():
        x = shared_result(str(a), "cfg", build)
        x["layers"].append(3)  # a caller's change never reaches the next caller
        y = shared_result(a, "cfg", build)
        assert y == {"layers": [1, 2]} and y is not x and len(builds) == 3
        shared_result(a, "other", build)  # another value of the same file: built
        assert len(builds) == 4
    shared_result(a, "cfg", build)  # dropped on leaving: built again
    assert len(builds) == 5

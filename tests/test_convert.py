"""Model conversion: a GGUF load written into place atomically, so an interrupted run leaves
nothing that `make` would take for a finished model."""

from __future__ import annotations

import pytest


def _fake_transformers(monkeypatch, fail_after_config: bool) -> None:
    """Stand-ins for the 35 s GGUF load: the model's save writes config.json first, as
    save_pretrained does, then the weights (or dies in between)."""
    import sys
    import types

    from engine import convert

    class Saved:
        def save_pretrained(self, folder, **kwargs) -> None:
            (folder / "config.json").write_text("{}")
            if fail_after_config:
                raise RuntimeError("killed while writing the weights")
            (folder / "model.safetensors").write_bytes(b"weights")

    class Tokenizer:
        def save_pretrained(self, folder) -> None:
            (folder / "tokenizer.json").write_text("{}")

    fake = types.SimpleNamespace(AutoTokenizer=types.SimpleNamespace(from_pretrained=lambda *a, **k: Tokenizer()),
                                 AutoModelForCausalLM=types.SimpleNamespace(from_pretrained=lambda *a, **k: None))
    monkeypatch.setitem(sys.modules, "transformers", fake)
    monkeypatch.setattr(convert, "_plain_copy", lambda loaded: Saved())


def test_an_interrupted_conversion_leaves_nothing_make_would_take_for_done(tmp_path, monkeypatch) -> None:
    from engine.convert import convert

    out = tmp_path / "models" / "smollm2"
    (tmp_path / "model.gguf").write_bytes(b"")
    _fake_transformers(monkeypatch, fail_after_config=True)
    with pytest.raises(RuntimeError):
        convert(out, tmp_path / "model.gguf")
    assert not (out / "config.json").exists()  # the Makefile's target: it would skip the conversion
    _fake_transformers(monkeypatch, fail_after_config=False)
    assert convert(out, tmp_path / "model.gguf") == out
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors", "tokenizer.json"]
    (out / "stale.bin").write_bytes(b"")  # converting again replaces the folder whole
    convert(out, tmp_path / "model.gguf")
    assert not (out / "stale.bin").exists() and [p.name for p in out.parent.iterdir()] == ["smollm2"]


def test_a_symlinked_model_folder_is_replaced_where_it_points(tmp_path, monkeypatch) -> None:
    from engine.convert import convert

    target = tmp_path / "disk" / "smollm2"
    target.mkdir(parents=True)
    link = tmp_path / "models" / "smollm2"
    link.parent.mkdir()
    link.symlink_to(target)
    (tmp_path / "model.gguf").write_bytes(b"")
    _fake_transformers(monkeypatch, fail_after_config=False)
    for _ in range(2):  # the second run found the renamed link in its way
        convert(link, tmp_path / "model.gguf")
    assert link.is_symlink() and (link / "model.safetensors").exists()
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["smollm2"]
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["smollm2"]


def test_an_out_folder_that_is_no_model_is_refused_before_the_load(tmp_path, monkeypatch, capsys) -> None:
    # The folder is replaced whole: `--out ''` (the working folder) had the project renamed aside
    # and deleted, and `--out data/models` every model in it.
    from engine import convert

    loads = []
    monkeypatch.setattr(convert, "find_gguf", lambda: loads.append("load") or tmp_path / "model.gguf")
    project = tmp_path / "project"
    (project / "src").mkdir(parents=True)
    (project / "src" / "notes.txt").write_text("precious")
    (project / "a_file").write_text("x")
    monkeypatch.chdir(project)
    for out, message in (("", "give the model folder a name"), (".", "the working folder"),
                         (str(tmp_path), "the working folder or one above it"), ("a_file", "a file"),
                         ("src", "holds no model")):
        assert convert.main(["--out", out]) == 2
        assert message in capsys.readouterr().err, out
    assert convert.main(["--out", "new", "--gguf", str(tmp_path / "missing.gguf")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert loads == [] and (project / "src" / "notes.txt").read_text() == "precious"
    assert sorted(p.name for p in project.iterdir()) == ["a_file", "src"]


def test_the_makefile_converts_into_the_folder_the_code_loads_by_default() -> None:
    # make spells the folder itself (it must know its target before any Python is installed).
    import re

    from predictor.paths import SERVED_MODEL_REF, project_root

    makefile = (project_root() / "Makefile").read_text()
    assert re.search(r"^MODEL_DIR := (\S+)$", makefile, re.M).group(1) == SERVED_MODEL_REF

"""Models named by their Hugging Face repo id (models/hub.py), from a real huggingface_hub
cache laid out in a temporary HF_HOME, offline (CI reaches no hub)."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

REPO = "spmd-test/tiny-llama"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def hf_home(tiny_models, tmp_path_factory) -> Path:
    """HF_HOME holding REPO in the hub's cache layout: refs/main names a snapshot folder
    with the model's files (as `hf download` leaves them, blobs aside)."""
    home = tmp_path_factory.mktemp("hf_home")
    repo = home / "hub" / ("models--" + REPO.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    shutil.copytree(tiny_models["llama"], repo / "snapshots" / COMMIT)
    return home


def hub_env(home: Path) -> dict:
    return {"HF_HOME": str(home), "HF_HUB_OFFLINE": "1"}


@pytest.mark.parametrize("spec, expected", [
    (REPO, True), ("mlx-community/Llama-3.2-3B-Instruct-4bit", True), ("./org/name", False),
    ("/org/name", False), ("a/b/c", False), ("name", False), ("org/..", False),
    ("tests", False)])
def test_what_counts_as_a_repo_id(spec, expected):
    from spmd_cp.models.hub import is_repo_id

    assert is_repo_id(spec) is expected


def test_cached_repo_id_answers_like_mlx_lm(hf_home, tiny_models):
    """Two ranks find the cached snapshot and decode mlx-lm's greedy tokens."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load_model

    from spmd_cp.models.loader import load_model as load_with_tokenizer

    prompt = "the quick brown fox jumps over the lazy dog"
    result = run_cli(2, ["generate", "--model", REPO, "--prompt", prompt, "--max-tokens", "5",
                         "--no-chat-template", "--json"], env=hub_env(hf_home)).last_json()
    path = tiny_models["llama"]
    ids = load_with_tokenizer(path).tokenizer.encode(prompt)
    model, _ = load_model(Path(path))
    expected = [int(t) for t, _ in generate_step(mx.array(np.asarray(ids)), model,
                                                 max_tokens=5, sampler=make_sampler(0.0))]
    assert result["token_ids"] == expected


def test_uncached_repo_id_offline_is_one_line(hf_home):
    result = run_cli(1, ["generate", "--model", "spmd-test/not-downloaded", "--prompt", "hi"],
                     env=hub_env(hf_home), check=False)
    assert result.returncode != 0
    lines = [line for line in result.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "spmd-test/not-downloaded" in lines[0], result.stderr
    assert "not in the Hugging Face cache" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert "Traceback" not in result.stderr

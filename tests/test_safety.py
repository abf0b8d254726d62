"""Launch safety and bad input: symlinks planted in a cache directory, damaged
model files, a launcher that belongs to another MPI than the one mpi4py loads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import SPMD_CP, run_cli, run_process
from spmd_cp.runtime.launcher import LauncherMismatch, check_launch
from spmd_cp.runtime.mpi_library import choose_mpi_library


def only_error_line(launch, *fragments):
    """Exit 2, and stderr is exactly one line: the error, holding every fragment."""
    assert launch.returncode == 2, launch.stderr[-3000:]
    lines = launch.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("spmd-cp: error: "), launch.stderr[-3000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def document(tmp_path_factory):
    path = tmp_path_factory.mktemp("safety") / "doc.txt"
    path.write_text("The river Saone meets the Rhone at Lyon, founded in 43 BC.")
    return path


# -- point 2: --save-cache never writes through a symlink, never outside its directory ----
def test_save_cache_replaces_planted_symlinks_and_leaves_their_targets_alone(tiny_models,
                                                                             tmp_path):
    cache = tmp_path / "cache"
    cache.mkdir()
    victims = [tmp_path / "victim", tmp_path / "victim2"]
    for victim in victims:
        victim.write_text("precious\n")
    (cache / "rank-0-of-2.safetensors").symlink_to(victims[0])
    (cache / "meta.json.tmp").symlink_to(victims[1])  # the old fixed temporary name
    outside = tmp_path / "created-outside"
    (cache / "rank-1-of-2.safetensors").symlink_to(outside)  # dangling: would create it
    model = ["--model", tiny_models["llama"], "--max-tokens", "2"]
    # --overwrite: the CLI refuses a directory already holding shard names without it.
    run_cli(2, ["generate", "--prompt", "Hello", "--save-cache", str(cache), "--overwrite",
                *model])

    assert [victim.read_text() for victim in victims] == ["precious\n"] * 2
    assert not outside.exists()
    written = ["meta.json", "rank-0-of-2.safetensors", "rank-1-of-2.safetensors"]
    for name in written:
        assert (cache / name).is_file() and not (cache / name).is_symlink(), name
    # No temporary file left behind; the planted link that is no longer ours stays.
    assert sorted(p.name for p in cache.iterdir()) == sorted(written + ["meta.json.tmp"])
    meta = json.loads((cache / "meta.json").read_text())
    resumed = run_cli(2, ["generate", "--prompt", "Again", "--load-cache", str(cache), "--json",
                          *model]).last_json()
    assert resumed["prompt_tokens_reused"] == meta["num_tokens"] > 0


# -- point 3: a damaged model is one line, exit 2, on every rank count -------------------
@pytest.fixture(scope="module")
def damaged_models(tmp_path_factory, embedded_model, tiny_models) -> dict:
    """name -> (model path, fragments the one error line must hold)."""
    root = tmp_path_factory.mktemp("damaged")
    truncated = root / "t.gguf"  # `head -c 20000000 model.gguf > t.gguf`
    with open(embedded_model, "rb") as f:
        truncated.write_bytes(f.read(20_000_000))
    text = root / "notes.gguf"
    text.write_text("these are my notes, not a model\n")
    models = {"truncated-gguf": (truncated, [str(truncated), "truncated",
                                             "'token_embd.weight'", "20000000"]),
              "text-gguf": (text, [str(text), "not a GGUF file"])}
    for name in ("cut-safetensors", "config-not-json", "missing-weights"):
        shutil.copytree(tiny_models["llama"], root / name)
    weights = root / "cut-safetensors" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    models["cut-safetensors"] = (weights.parent, [str(weights), "truncated"])
    config = root / "config-not-json" / "config.json"
    config.write_text("{model_type: llama")
    models["config-not-json"] = (config.parent, [str(config)])
    # Whole files that do not fit together: found only by the loader itself.
    config = root / "missing-weights" / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "num_hidden_layers": 4}))
    models["missing-weights"] = (config.parent, [str(config.parent), "model.layers.3"])
    return models


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("damage", ["truncated-gguf", "text-gguf", "cut-safetensors",
                                    "config-not-json", "missing-weights"])
def test_damaged_model_is_one_line_and_exit_2(damage, n, damaged_models, document, tmp_path):
    path, fragments = damaged_models[damage]
    output = tmp_path / "scores.jsonl"
    launch = run_cli(n, ["score", "--model", str(path), "--text-file", str(document),
                         "--output", str(output)], check=False)
    only_error_line(launch, *fragments)
    assert not output.exists()


# -- point 6: a launcher of another MPI is refused before any work ------------------------
# What a rank of Open MPI's mpirun sees: its place, and its launcher's address (Open MPI
# 4's; without a PMIx server's address, so that no Open MPI library is chosen for it).
OPEN_MPI_RANK_0 = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
                   "OMPI_MCA_orte_hnp_uri": "1.0;tcp://127.0.0.1:9"}


@pytest.fixture(scope="module")
def mpi_library() -> str:
    """The first line of MPI_Get_library_version of the MPI that mpi4py loads."""
    out = subprocess.run([sys.executable, "-m", "mpi4py", "--mpi-lib-version"], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    return " ".join(out.strip().splitlines()[0].split())


def test_singleton_under_another_launchers_variables_is_refused(tiny_models, document,
                                                                mpi_library, tmp_path):
    """An MPICH singleton started with Open MPI's rank variables: what every rank of
    `mpiexec -n 2` sees when mpiexec and mpi4py's library are different MPIs."""
    output = tmp_path / "scores.jsonl"
    score = SPMD_CP + ["score", "--model", tiny_models["llama"], "--text-file", str(document),
                       "--output", str(output)]
    refused = run_process(score, env=OPEN_MPI_RANK_0, check=False)
    only_error_line(refused, "one of 2 ranks", "Open MPI", "OMPI_COMM_WORLD_SIZE=2",
                    mpi_library, "mpiexec", "MPI4PY_LIBMPI")
    assert not output.exists()
    # The launcher's rank 1 exits the same way, silently: the line is printed once per job.
    other = run_process(score, env={**OPEN_MPI_RANK_0, "OMPI_COMM_WORLD_RANK": "1"},
                        check=False)
    assert (other.returncode, other.stderr) == (2, "")
    # Started alone with only the rank variables: no launcher started the others, so
    # this process says why it stops, whatever its rank.
    alone = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}
    only_error_line(run_process(score, env=alone, check=False), "rank 1 of 2",
                    "OMPI_COMM_WORLD_SIZE=2", "started alone", mpi_library)
    run_process(score)  # the same command without a launcher's variables: a real singleton
    assert len(output.read_text().splitlines()) > 5


def test_doctor_refuses_another_launcher_the_same_way(mpi_library):
    refused = run_process(SPMD_CP + ["doctor"], env=OPEN_MPI_RANK_0, check=False)
    only_error_line(refused, "one of 2 ranks", "OMPI_COMM_WORLD_SIZE=2", mpi_library)
    assert refused.stdout == ""


def test_a_pmix_launcher_gets_its_open_mpi_library_or_one_line(tmp_path):
    """Where the launcher's Open MPI library is looked for (OPAL_PREFIX, beside the
    launcher on PATH, the system's folders), and when the default stays."""
    def install(prefix):
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "mpirun").write_text("#!/bin/sh\n")
        (prefix / "lib").mkdir()
        (prefix / "lib" / "libmpi.so.40").write_bytes(b"")
        return str(prefix / "lib" / "libmpi.so.40")

    opal, on_path = install(tmp_path / "opal"), install(tmp_path / "ompi")
    pmix = {"PMIX_SERVER_URI41": "1.0;tcp4://127.0.0.1:9", "PMIX_RANK": "0",
            "PATH": f"{tmp_path / 'empty'}:{tmp_path / 'ompi' / 'bin'}"}
    for environ, system_dirs, chosen in [
        ({**pmix, "OPAL_PREFIX": str(tmp_path / "opal")}, [], opal),
        (dict(pmix), [], on_path),
        ({**pmix, "PATH": ""}, [str(tmp_path / "ompi" / "lib")], on_path),
        ({**pmix, "PMI_RANK": "0"}, [], None),  # MPICH's mpiexec: its default is right
        ({**pmix, "MPI4PY_LIBMPI": "/mine.so"}, [], None),  # the user's choice stands
        ({"PATH": pmix["PATH"]}, [], None),  # no launcher
    ]:
        before = dict(environ)
        assert choose_mpi_library(environ, system_dirs) == chosen, environ
        assert environ == (before if chosen is None else {**before, "MPI4PY_LIBMPI": chosen})
    # Nowhere to be found, and mpi4py would load the MPICH wheel: one line, once per job.
    for rank, shown in (("0", True), ("1", False)):
        with pytest.raises(LauncherMismatch, match="MPI4PY_LIBMPI=") as error:
            choose_mpi_library({**pmix, "PATH": "", "PMIX_RANK": rank}, [])
        assert error.value.shown == shown and "mpich" in str(error.value)


def open_mpi_launcher() -> str | None:
    """Open MPI's mpirun (beside its ompi_info), or None where Open MPI is not installed."""
    info = shutil.which("ompi_info")
    mpirun = Path(info).with_name("mpirun") if info else None
    return str(mpirun) if mpirun is not None and mpirun.exists() else None


def test_open_mpi_mpirun_loads_its_own_library_and_answers_as_mpiexec(tiny_models):
    """Under Open MPI's mpirun, with the MPICH wheel installed and nothing set, every rank
    loads Open MPI's library (found from the launcher) and the job answers what the
    MPICH wheel's mpiexec answers, token for token."""
    mpirun = open_mpi_launcher()
    if mpirun is None:
        pytest.skip("Open MPI is not installed here (apt-get install openmpi-bin)")
    args = ["generate", "--model", tiny_models["qwen3"], "--prompt", "The quick brown fox",
            "--max-tokens", "8", "--json"]
    expected = run_cli(2, args).last_json()
    as_root = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    env = {**as_root, "OMPI_MCA_rmaps_base_oversubscribe": "1"}
    got = run_process([mpirun, "-n", "2", *SPMD_CP, *args], env=env, timeout=300).last_json()
    assert got["ranks"] == 2 and got["token_ids"] == expected["token_ids"]


@pytest.mark.parametrize("environ, world_size, refused", [
    ({}, 1, False),
    ({"PMI_SIZE": "2", "PMI_RANK": "0"}, 2, False),  # a working launch
    ({"PMI_SIZE": "2", "PMI_RANK": "0", "MPI_LOCALNRANKS": "2"}, 1, True),  # Hydra + Open MPI
    ({"PMI_SIZE": "1", "PMI_RANK": "0"}, 1, False),  # mpiexec -n 1
    # An sbatch script or salloc shell: SLURM_NTASKS describes the allocation, not us.
    ({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4", "SLURM_PROCID": "0"}, 1, False),
    ({"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "0", "SLURM_NTASKS": "4"}, 1, True),  # srun
    # mpiexec -n 1 inside a 2-node allocation: its proxies' srun step counts nodes.
    ({"PMI_SIZE": "1", "PMI_RANK": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}, 1,
     False),
    ({"PMIX_RANK": "3"}, 1, True),  # a PMIx launcher gives only the rank
    ({"PMIX_RANK": "0"}, 1, False),
])
def test_which_environments_say_one_of_several_ranks(environ, world_size, refused):
    if not refused:
        check_launch(world_size, "Some MPI 1.0\nmore", environ)
        return
    with pytest.raises(LauncherMismatch, match="Some MPI 1.0"):
        check_launch(world_size, "Some MPI 1.0\nmore", environ)

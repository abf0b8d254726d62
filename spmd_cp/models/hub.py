"""Models named by their Hugging Face repo id, found the way mlx-lm finds them.

``--model mlx-community/Llama-3.2-3B-Instruct-4bit`` is looked up in huggingface_hub's
cache (``HF_HOME`` / ``HF_HUB_CACHE`` honoured) and downloaded there when it is missing
and the hub may be reached, with mlx-lm's own file patterns (config, safetensors,
tokenizer files). A local path always wins over a repo id of the same spelling.

Which rank downloads is the caller's business (run/builder.py: one rank per host); this
module only answers "where is it on this host".
"""

from __future__ import annotations

import os
import re

from ..errors import UserError

# "org/name": one slash, the characters the hub allows, no leading "." or "/".
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def is_repo_id(spec: str) -> bool:
    """Whether ``spec`` names a hub repository rather than a local path: it is not an
    existing file or folder and is spelled ``org/name``."""
    return not os.path.exists(spec) and bool(_REPO_ID.match(spec)) and ".." not in spec


def local_snapshot(repo_id: str, download: bool) -> str:
    """The folder holding ``repo_id``'s model files on this host. ``download``: fetch what
    the cache lacks (unless ``HF_HUB_OFFLINE`` is set); otherwise the cache alone.
    Raises UserError naming the repo and what to do."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError,
                                        LocalEntryNotFoundError, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    offline = bool(constants.HF_HUB_OFFLINE)
    try:
        return snapshot_download(repo_id, allow_patterns=DEFAULT_ALLOW_PATTERNS,
                                 local_files_only=offline or not download)
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if offline else "it was not downloaded on this host"
        raise UserError(f"model {repo_id} is not in the Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}) and {why}: download it first "
                        f"(hf download {repo_id}) or pass a local path") from None
    except GatedRepoError:
        raise UserError(f"model {repo_id} is gated on the Hugging Face Hub: accept its "
                        "licence there and log in (hf auth login or HF_TOKEN)") from None
    except (RepositoryNotFoundError, RevisionNotFoundError):
        raise UserError(f"no model {repo_id} on the Hugging Face Hub (a private one needs "
                        "a login: hf auth login or HF_TOKEN); a local folder needs a path "
                        "that exists") from None
    except (HfHubHTTPError, OSError, ValueError) as error:  # the hub's, the network's, the disk's
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"cannot fetch model {repo_id}: {first}") from None

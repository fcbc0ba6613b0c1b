"""Is a hub model or dataset usable *now*? Answered in seconds, before anything is built (not after minutes of
retries inside transformers). HF_HUB_OFFLINE=1: only the local cache counts; otherwise the hub's API is asked
once, with a short timeout; an unreachable hub's message says to set HF_HUB_OFFLINE=1 to use a cached copy.
"""
from __future__ import annotations

import urllib.error
import urllib.parse
import urllib.request

TIMEOUT_S = 5.0


def ask_hub(kind: str, repo_id: str) -> str | None:
    """None if `repo_id` exists on the hub ('models' or 'datasets'), else why it cannot be used."""
    from huggingface_hub import constants, get_token
    endpoint = constants.ENDPOINT.rstrip("/")
    url = f"{endpoint}/api/{kind}/{urllib.parse.quote(repo_id, safe='/')}"
    token = get_token()
    request = urllib.request.Request(url, method="GET", headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S):
            return None  # 200: the repo exists and this user may read it
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            return (f"{repo_id} on {endpoint} is private or gated (HTTP {err.code}); accept its license on the "
                    f"hub and log in (hf auth login)")
        if err.code == 404:
            return f"there is no {kind[:-1]} {repo_id} on {endpoint}"
        return f"{endpoint} answered HTTP {err.code} for {repo_id}"
    except (urllib.error.URLError, OSError) as err:  # no DNS, refused, timeout, proxy
        reason = getattr(err, "reason", err)
        return (f"the hub ({endpoint}) cannot be reached ({reason}); connect to the network, or set "
                f"HF_HUB_OFFLINE=1 to use a copy in the Hugging Face cache")


def model_unavailable(repo_id: str) -> str | None:
    """None if the hub model can be loaded now (cached under HF_HUB_OFFLINE=1, or on the hub)."""
    from huggingface_hub import constants, try_to_load_from_cache
    if constants.HF_HUB_OFFLINE:
        if isinstance(try_to_load_from_cache(repo_id, "config.json"), str):
            return None
        return (f"HF_HUB_OFFLINE=1 and {repo_id} is not in the Hugging Face cache (HF_HOME / HF_HUB_CACHE); "
                f"download it once with network access (hf download {repo_id})")
    return ask_hub("models", repo_id)


def dataset_unavailable(repo_id: str) -> str | None:
    """None if the hub dataset can be loaded now (under HF_HUB_OFFLINE=1 `datasets` answers that at once)."""
    from huggingface_hub import constants
    return None if constants.HF_HUB_OFFLINE else ask_hub("datasets", repo_id)

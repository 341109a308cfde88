"""Pushing the registry's champion to a Hugging Face Hub model repository (`promote.hub`).

After each gate the repository's branch is made to hold exactly the champion's model folder: one commit that adds
its files and deletes any the previous champion had and it has not, tagged with the version name (`v0003`;
`staging-v0003` on a branch `staging`) so a user can pin it. The registry's `hub.json` records which version each
repository and branch holds, so a gate that kept the champion pushes nothing, and a push that failed (no network, a
bad token, the Hub down) is a warning: the local promotion stands, and the next gate pushes the champion again.
"""

from __future__ import annotations

import json
import os
import time

from sftflow.tasks.core.atomic import write_atomic
from sftflow.tasks.core.logs import stage_logger
from sftflow.tasks.core.manifests import HubPush, HubTarget
from sftflow.tasks.eval.registry import ModelVersion, Registry

STATE = "hub.json"
_DEFAULT_ENDPOINT = "https://huggingface.co"


def endpoint_of(target: HubTarget) -> str:
    return (target.endpoint or os.environ.get("HF_ENDPOINT") or _DEFAULT_ENDPOINT).rstrip("/")


def target_key(target: HubTarget) -> str:
    return f"{endpoint_of(target)}/{target.repo}@{target.revision}"


def tag_name(version: ModelVersion, target: HubTarget) -> str:
    """`v0003` on main; `staging-v0003` on a branch `staging`, since tags are per repository, not per branch."""
    return version.name if target.revision == "main" else f"{target.revision}-{version.name}"


def _state(registry: Registry) -> dict:
    """What each target holds; an unreadable file counts as nothing pushed (the push then writes it anew)."""
    path = registry.root / STATE
    try:
        state = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, json.JSONDecodeError):
        return {}
    return state if isinstance(state, dict) else {}


def push_version(version: ModelVersion, target: HubTarget) -> HubPush:
    """Commit `version`'s model folder to the target branch (creating the repository and branch when missing) and
    tag the commit with the version name. Raises what the Hub client raises."""
    from huggingface_hub import HfApi

    endpoint = endpoint_of(target)
    api = HfApi(endpoint=endpoint, token=os.environ.get(target.token_env) or None)
    api.create_repo(target.repo, private=target.private, exist_ok=True, repo_type="model")
    if target.revision != "main":
        api.create_branch(target.repo, branch=target.revision, exist_ok=True, repo_type="model")
    card = version.card
    loss = (card.get("eval") or {}).get("loss")
    description = "\n".join(
        f"- {key}: {value}"
        for key, value in (
            ("registry version", version.name),
            ("files sha256", version.sha256),
            ("source", (card.get("source") or {}).get("model")),
            ("eval loss", None if loss is None else f"{loss:.4f}"),
        )
        if value is not None
    )
    info = api.upload_folder(
        repo_id=target.repo,
        folder_path=version.model_dir,
        repo_type="model",
        revision=target.revision,
        commit_message=f"sftflow champion {version.name}",
        commit_description=description,
        delete_patterns="*",  # the branch holds this version alone, not files left from the one before
    )
    commit = getattr(info, "oid", None)
    tag = _tag_commit(api, target, tag_name(version, target), commit)
    url = getattr(info, "commit_url", None) or f"{endpoint}/{target.repo}/tree/{target.revision}"
    return HubPush(
        ok=True, repo=target.repo, revision=target.revision, version=version.name, commit=commit, url=url, tag=tag
    )


def _tag_commit(api, target: HubTarget, tag: str, commit: str | None) -> str | None:
    """Tag `commit` as `tag`, and return the tag; None, with a warning, when the name already tags another commit.
    A registry started afresh (its folder deleted) numbers from v0001 again, and moving a published tag would hand
    whoever pinned it another model, so the old tag stays and this commit goes untagged."""
    api.create_tag(target.repo, tag=tag, revision=commit or target.revision, exist_ok=True)
    if commit is None:
        return tag
    held = {ref.name: ref.target_commit for ref in api.list_repo_refs(target.repo).tags}.get(tag)
    if held is None or held == commit:
        return tag
    stage_logger("sftflow.promote").warning(
        "promote: tag %s in %s already names commit %s, not this champion's %s (was the registry started afresh?); "
        "the tag is left as it is and this commit is untagged: pin it by its commit id",
        tag, target.repo, held[:12], commit[:12],
    )  # fmt: skip
    return None


def sync_champion(registry: Registry, target: HubTarget) -> HubPush | None:
    """Make the target hold the registry's champion, unless `hub.json` says it already does. Never raises for the
    Hub's sake: a failed push is a warning and an `ok=False` result. Call while holding `registry.lock()`."""
    champion = registry.champion()
    if champion is None:
        return None
    key = target_key(target)
    try:
        state = _state(registry)
        held = state.get(key)
        if held and held.get("version") == champion.name and held.get("sha256") == champion.sha256:
            fields = {k: held.get(k) for k in ("repo", "revision", "version", "commit", "url")}
            return HubPush(ok=True, tag=held.get("tag", tag_name(champion, target)), **fields)
        pushed = push_version(champion, target)
    except Exception as err:  # noqa: BLE001 -- the Hub's failure must not undo the local promotion
        message = f"{type(err).__name__}: {err}".splitlines()[0]
        stage_logger("sftflow.promote").warning(
            "promote: %s was not pushed to %s (%s); the next gate pushes it", champion.name, key, message
        )
        return HubPush(ok=False, repo=target.repo, revision=target.revision, version=champion.name, error=message)
    state[key] = {**pushed.model_dump(exclude={"ok", "error"}), "sha256": champion.sha256, "time": time.time()}
    write_atomic(registry.root / STATE, json.dumps(state, indent=2))
    return pushed

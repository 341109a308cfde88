"""Checks of the tokens and masks training will see, on the sampled documents.

- `ids and masks = HF`: each conversation's ids (and, where the template has `{% generation %}` tags and the policy
  is `generation`, its trained-token mask) equal what Hugging Face's
  `apply_chat_template(messages, tools=..., chat_template=<the template used>, tokenize=True,
  return_assistant_tokens_mask=True)` gives. Compared as the template writes them (no BOS or EOS added: those are
  sftflow's spans policy, checked by the stop check below).
- `ids = model's own template`: when the data is rendered with another template than the tokenizer's own (`auto`
  picks a shipped copy with generation tags), whether the ids equal what the tokenizer's own template gives. A
  difference is reported, not failed: the export ships the template training rendered with, so inference renders
  as training did; but the model then learns a format (often for tools) its own template never wrote.
- `one stop per trained turn`: in the ids training sees, every run of trained tokens holds exactly one stop (EOS or a
  special added token such as `<|im_end|>` or `<|eot_id|>`), with nothing but whitespace trained after it: the model
  learns to end each turn, once.
"""

from __future__ import annotations

import numpy as np

from sftflow.tasks.check.results import CheckRow
from sftflow.tasks.check.sample import SampledDoc
from sftflow.tasks.data.chat_template import ChatTemplate
from sftflow.tasks.data.spans import _end_of_turn_ids, mask_to_spans


def hf_encoding(tokenizer, doc: SampledDoc, template_text: str | None, with_mask: bool):
    """(ids, mask or None) from Hugging Face's `apply_chat_template`; `template_text` None: the tokenizer's own."""
    conversation = doc.conversation
    out = tokenizer.apply_chat_template(
        conversation.messages,
        tools=conversation.tools,
        chat_template=template_text,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=with_mask,
    )
    ids = np.asarray(out["input_ids"], dtype=np.int64)
    return ids, np.asarray(out["assistant_masks"], dtype=np.uint8) if with_mask else None


def _first_difference(tokenizer, ours: np.ndarray, theirs: np.ndarray) -> str:
    n = min(len(ours), len(theirs))
    k = next((i for i in range(n) if ours[i] != theirs[i]), n)

    def show(ids, k):
        return repr(tokenizer.convert_ids_to_tokens(int(ids[k]))) if k < len(ids) else "end"

    return f"token {k}: sftflow {show(ours, k)}, Hugging Face {show(theirs, k)} ({len(ours)} vs {len(theirs)} tokens)"


def ids_and_masks_match_hf(docs: list[SampledDoc], tokenizer, template: ChatTemplate, mask_policy: str) -> CheckRow:
    with_mask = template.has_generation_tag and mask_policy == "generation"
    compared = [d for d in docs if d.conversation is not None and d.templated is not None]
    name = "ids and masks = HF" if with_mask else "ids = HF"
    if not compared:
        return CheckRow(name=name, passed=True, measured="0 documents", bound="equal", detail="no chat records")
    id_failures, mask_failures, tokens_off = [], [], 0
    for doc in compared:
        ids, mask = hf_encoding(tokenizer, doc, template.text, with_mask)
        ours = doc.templated.input_ids
        if not np.array_equal(ours, ids):
            id_failures.append(f"{doc.source}: {_first_difference(tokenizer, ours, ids)}")
            continue
        if with_mask:
            differ = int((doc.templated.loss_mask() != mask).sum())
            if differ:
                k = int(np.flatnonzero(doc.templated.loss_mask() != mask)[0])
                token = tokenizer.convert_ids_to_tokens(int(ours[k]))
                mask_failures.append(
                    f"{doc.source}: {differ} token(s) differ, first {k} ({token!r}): sftflow "
                    f"{int(doc.templated.loss_mask()[k])}, Hugging Face {int(mask[k])}"
                )
                tokens_off += differ
    n = len(compared)
    measured = f"ids {n - len(id_failures)}/{n} equal"
    if with_mask:
        measured += f", masks {n - len(id_failures) - len(mask_failures)}/{n - len(id_failures)} ({tokens_off} tok off)"
    notes = []
    if not with_mask:
        why = "has no {% generation %} tags" if not template.has_generation_tag else "is not masked by its tags"
        notes.append(f"template {template.name} {why} (mask_policy {mask_policy}): ids compared, masks not")
    skipped = len(docs) - n
    if skipped:
        notes.append(f"{skipped} document(s) not compared (text records, or nothing trained)")
    failures = id_failures + mask_failures
    if failures:
        notes.insert(0, failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else ""))
    return CheckRow(name=name, passed=not failures, measured=measured, bound="equal", detail="; ".join(notes))


def ids_match_own_template(docs: list[SampledDoc], tokenizer, template: ChatTemplate) -> CheckRow | None:
    """None when the data is rendered with the tokenizer's own template, or the tokenizer has none."""
    own = getattr(tokenizer, "chat_template", None)
    if not isinstance(own, str) or own == template.text:
        return None
    own_template = ChatTemplate(own, tokenizer.special_tokens_map, name="the tokenizer's own")
    row = ids_and_masks_match_hf(docs, tokenizer, own_template, "roles")
    where = f"rendered with {template.name}, compared with the tokenizer's own chat_template"
    if not row.passed:
        where += " (the export ships the former)"
    failure = [row.detail.split("; ")[0]] if not row.passed else []
    update = {"name": "ids = model's own template", "detail": "; ".join([*failure, where]), "required": False}
    return row.model_copy(update=update)


def one_stop_per_trained_turn(docs: list[SampledDoc], tokenizer) -> CheckRow:
    stops = _end_of_turn_ids(tokenizer)
    turns = good = 0
    failures = []
    for doc in docs:
        if doc.trained is None:
            continue
        ids, mask = doc.trained.input_ids, doc.trained.loss_mask()
        for k, (start, end) in enumerate(mask_to_spans(mask)):
            turns += 1
            run = ids[start:end]
            at = [i for i, t in enumerate(run) if int(t) in stops]
            after = tokenizer.decode(run[at[-1] + 1 :].tolist()) if at else ""
            if len(at) == 1 and not after.strip():
                good += 1
                continue
            tail = tokenizer.decode(run[-8:].tolist())
            what = "no stop" if not at else f"{len(at)} stops" if len(at) > 1 else f"{after!r} trained after the stop"
            failures.append(f"{doc.source}: trained turn {k} has {what}; it ends {tail!r}")
    detail = ""
    if failures:
        detail = failures[0] + (f" (+{len(failures) - 1} more)" if len(failures) > 1 else "")
        detail += "; end each trained turn with its stop inside the {% generation %} block, or set data.spans.eos"
    if not failures and turns == 0:
        detail = "no trained turn in the sample"
    return CheckRow(
        name="one stop per trained turn",
        passed=turns > 0 and not failures,
        measured=f"{good}/{turns} turns",
        bound="1 stop each (EOS or a special token)",
        detail=detail,
    )

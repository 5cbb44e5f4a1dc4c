"""The datastores a run can draft from (`datastore=`, spd.datastore): `sharegpt` — the assistant turns of the ShareGPT
conversations, tokenised for the run's target and kept under $SPD_CACHE_DIR/datastore/<tokenizer key>.safetensors the
first time (about half a minute on 2 cores for the default target; every later start reads the file) — or the path of
a datastore file that `Datastore.save` wrote for the same tokenizer.

Held out of `sharegpt` explicitly, as they are held out of training: the everyday benchmark set's conversations
(every part of each), and any conversation whose user turns contain the opening of an eval prompt (none did when
this was written; the count is kept in the file's metadata).
"""

from __future__ import annotations

import os
import re
import sys

from spd.datastore import Datastore, tokenizer_key
from spd.errors import UserError

SHAREGPT = "sharegpt"
OPENING = 80        # characters of an eval prompt (whitespace folded, lower case) that mark a conversation as its copy


def _folded(text: str) -> str:
    return re.sub(r"\s+", " ", text.lower()).strip()


def sharegpt_documents(log=print) -> tuple[list[str], dict]:
    """The assistant turns a `sharegpt` datastore holds, and what was held out."""
    from spd.prompts import DATASETS, load_questions
    from spd.sharegpt import _sharegpt_file, complete_records, held_out_ids, normalise

    everyday = {record_id.rsplit("_", 1)[0] for record_id in held_out_ids()}
    openings = [_folded(q["turns"][0].replace("Complete the code I provided.", ""))[:OPENING]
                for ds in DATASETS for q in load_questions(ds)]
    openings = [o for o in openings if len(o) >= 30]
    texts, dropped = [], {"everyday": 0, "eval": 0}
    for record in complete_records(_sharegpt_file(), log=log):
        if str(record.get("id", "")).rsplit("_", 1)[0] in everyday:
            dropped["everyday"] += 1
            continue
        messages = normalise(record) or []
        asked = _folded(" ".join(m["content"] for m in messages if m["role"] == "user"))
        if any(opening in asked for opening in openings):
            dropped["eval"] += 1
            continue
        texts += [m["content"] for m in messages if m["role"] == "assistant" and m["content"].strip()]
    return texts, {"records_dropped": dropped, "documents": len(texts)}


def _say(message: str) -> None:
    print(f"[spd] {message}", file=sys.stderr)


def open_datastore(spec: str, tokenizer, vocab_size: int, log=_say) -> Datastore:
    """`sharegpt` (built and cached per tokenizer) or a datastore file; refused where its ids are another
    tokenizer's."""
    key = tokenizer_key(tokenizer)
    if spec == SHAREGPT:
        from spd.targets.weight_cache import cache_root

        path = os.path.join(cache_root(), "datastore", f"{SHAREGPT}-{key}.safetensors")
        if os.path.isfile(path):
            try:
                return Datastore.load(path)
            except Exception as exc:        # a file of an older format, or damaged: built again below
                log(f"the cached ShareGPT datastore {path} cannot be read ({exc}); building it again")
        else:
            log(f"building the ShareGPT datastore for this tokenizer once (about half a minute): {path}")
        texts, held = sharegpt_documents(log=lambda message: None)
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
        store = Datastore.build(ids, max(vocab_size, len(tokenizer)), {"source": SHAREGPT, "tokenizer": key, **held})
        os.makedirs(os.path.dirname(path), exist_ok=True)
        store.save(path)
        return store
    if not os.path.isfile(spec):
        raise UserError(f"datastore={spec!r} is neither {SHAREGPT!r} nor a datastore file; give one of those "
                        "(or leave it unset: no datastore)")
    try:
        store = Datastore.load(spec)
    except Exception as exc:      # safetensors raises its own error types for a file that is not one of its own
        raise UserError(f"datastore={spec!r} is not a datastore file ({exc}); build one with "
                        "spd.datastore.Datastore.build(...).save(path)") from None
    if store.meta.get("tokenizer") != key:
        raise UserError(f"datastore={spec!r} holds ids of another tokenizer than this target's; build it for this "
                        "target's tokenizer")
    return store

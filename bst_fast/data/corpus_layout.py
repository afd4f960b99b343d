"""What makes a folder a prepared corpus (its file names, its manifest's format): below both
data/text.py, which must not read one as raw text, and data/prepared.py, which writes and reads them."""
from __future__ import annotations

import json
import os
from pathlib import Path

FORMAT, VERSION = "bst_fast.prepared", 1
MANIFEST, TOKENS, OFFSETS, TOKENIZER = "manifest.json", "tokens.bin", "offsets.bin", "tokenizer.json"


def is_prepared(path) -> bool:
    """Whether `path` is a folder holding a prepared corpus (checked on open): a manifest.json of this
    format, or a manifest.json that does not parse beside a tokens.bin or offsets.bin (a damaged
    corpus, reported as such when opened). Another tool's manifest.json makes no folder a corpus:
    it is trained as raw text, and `tokenize --out` refuses to replace it."""
    try:
        if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, MANIFEST))):
            return False
    except (TypeError, ValueError):
        return False
    try:
        m = json.loads(Path(path, MANIFEST).read_bytes().decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        m = None
    if isinstance(m, dict) and m.get("format") == FORMAT:
        return True
    # a damaged manifest (its format too) beside our token files: a corpus, reported corrupt on open
    return any(os.path.exists(os.path.join(path, name)) for name in (TOKENS, OFFSETS))

"""JSON-lines files as the data and evaluation tests write them: one row a line, a string row as it
is (a malformed line on purpose), anything else as JSON."""

import json


def _write_jsonl(path, rows):
    with open(path, "w") as f:
        for row in rows:
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)

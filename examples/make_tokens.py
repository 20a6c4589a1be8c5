"""A small tokenised dataset to try ffplane with: ``python examples/make_tokens.py OUT.parquet``.

Rows of 64 token ids (vocabulary 512), as the example GPT reads them; ingest it with
``dataserver ingest OUT.parquet --out DATA_DIR/tokens``.
"""

import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

VOCAB, SEQ, ROWS = 512, 64, 4096


def main() -> None:
    if len(sys.argv) != 2:
        raise SystemExit("usage: python examples/make_tokens.py OUT.parquet")
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, VOCAB, size=(ROWS, SEQ), dtype=np.int32)
    pq.write_table(pa.table({"tokens": pa.array(list(tokens), pa.list_(pa.int32(), SEQ))}), sys.argv[1])
    print(f"wrote {ROWS} rows of {SEQ} tokens to {sys.argv[1]}")


if __name__ == "__main__":
    main()

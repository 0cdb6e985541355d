"""The runner on a sidecar's shared-memory pool: one process prefills into the pages, another
decodes from them (zero copy), and the result equals transformers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deltakv.services.model.loader import load_transformers_model, loaded_from_transformers
from deltakv.services.model.runner import DecodeSeq, ModelRunner
from deltakv.sidecar.pool import SharedKVPool

REPO = Path(__file__).resolve().parents[2]
PROMPT = [1, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170, 180, 190, 200,
          210, 220, 230, 2, 1, 33, 34, 35]
TABLE = [9, 3, 6]

CHILD = textwrap.dedent("""
    import json, sys
    from deltakv.services.model.loader import load_model
    from deltakv.services.model.runner import ModelRunner
    from deltakv.sidecar.pool import SharedKVPool

    name, prompt, table = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
    model = load_model("tiny-random")
    pool = SharedKVPool.attach(name, model.kv_layout(page_size=16, num_pages=12))
    logits = ModelRunner(model, pool.tensor).prefill(prompt, table, 0)
    print(json.dumps(logits.tolist()))
""")


@pytest.mark.timeout(300)
def test_prefill_in_one_process_decode_in_another():
    hf_model, tokenizer = load_transformers_model("tiny-random")
    model = loaded_from_transformers("tiny-random", hf_model, tokenizer)
    layout = model.kv_layout(page_size=16, num_pages=12)
    with torch.inference_mode():
        reference = hf_model(torch.tensor([PROMPT + [7, 8]])).logits[0].float()
    pool = SharedKVPool.create(layout)
    try:
        child = subprocess.run(
            [sys.executable, "-c", CHILD, pool.name, json.dumps(PROMPT), json.dumps(TABLE)],
            cwd=REPO, capture_output=True, text=True, timeout=240, check=False)
        assert child.returncode == 0, child.stderr
        prefill_logits = torch.tensor(json.loads(child.stdout))
        torch.testing.assert_close(prefill_logits, reference[len(PROMPT) - 1], atol=1e-4,
                                   rtol=0)
        # The child's K/V is in this process's mapping: only the table's pages were written.
        written = {p for p in range(12) if pool.tensor[p].abs().sum() > 0}
        assert written == {9, 3}
        runner = ModelRunner(model, pool.tensor)
        for step, token in enumerate([7, 8]):
            pos = len(PROMPT) + step
            logits = runner.decode_step([DecodeSeq(token, pos, TABLE)])
            torch.testing.assert_close(logits[0], reference[pos], atol=1e-4, rtol=0)
    finally:
        pool.close()

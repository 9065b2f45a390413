"""prepack=False: an ONNX Runtime session that uses the weights where they lie, in the artifact's
memory-mapped data file, instead of repacking them into a copy of its own. It computes what a
repacking session computes, and it adds next to nothing to the process's private memory, so
any number of such sessions (the server's logits and generate models) hold the weights once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from moedeploy.runtime.ort import DISABLE_PREPACKING, create_session

SMAPS = Path("/proc/self/smaps_rollup")


@pytest.fixture(scope="module")
def wide_vocabulary(tmp_path_factory):
    """A 1-layer Mixtral whose LM head is 32 MiB of fp32 (vocabulary 65,536 x hidden 128): the
    weight a session would repack, large beside what a session allocates otherwise."""
    from moedeploy.export.exporter import export
    from tests.families.cases import _family_config, make_model, save_checkpoint

    root = tmp_path_factory.mktemp("wide-vocabulary")
    config = _family_config("mixtral", 1, hidden_size=128, head_dim=16, intermediate_size=32, num_local_experts=2,
                            num_experts_per_tok=1, vocab_size=65536)
    checkpoint = save_checkpoint(make_model(config, seed=0), root / "checkpoint")
    return export("decoder", root / "artifact", checkpoint=checkpoint, golden=False)


def prefill(session) -> np.ndarray:
    feed = {"input_ids": np.array([[3, 1, 4, 1, 5]], dtype=np.int64)}
    for value in session.get_inputs()[1:]:  # the empty past of every layer
        feed[value.name] = np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in value.shape],
                                    dtype=np.float32)
    return session.run(["logits"], feed)[0]


def test_a_session_on_the_mapped_weights_computes_the_same_logits(wide_vocabulary) -> None:
    packed = create_session(wide_vocabulary, threads=1)
    mapped = create_session(wide_vocabulary, threads=1, prepack=False)
    assert mapped.session.get_session_options().get_session_config_entry(DISABLE_PREPACKING) == "1"
    np.testing.assert_allclose(prefill(mapped.session), prefill(packed.session), rtol=1e-5, atol=1e-5)


#: run in a fresh interpreter: in a process that has freed memory before, a new session reuses
#: the freed heap and its anonymous memory grows by less than it allocates
MEASURE = """
import json, sys
import numpy as np
from moedeploy.runtime.ort import create_session

def anonymous_mb():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024

def prefill(session):
    feed = {"input_ids": np.array([[3, 1, 4, 1, 5]], dtype=np.int64)}
    for value in session.get_inputs()[1:]:
        feed[value.name] = np.zeros([1 if d == "batch" else 0 if isinstance(d, str) else d for d in value.shape],
                                    dtype=np.float32)
    session.run(["logits"], feed)

growth, sessions = [], []
for prepack in (True, False, False):
    before = anonymous_mb()
    sessions.append(create_session(sys.argv[1], threads=1, prepack=prepack))
    prefill(sessions[-1].session)
    growth.append(anonymous_mb() - before)
print(json.dumps(growth))
"""


@pytest.mark.skipif(not SMAPS.exists(), reason="reads Linux's /proc/self/smaps_rollup")
def test_sessions_on_the_mapped_weights_add_no_copy_of_them(wide_vocabulary) -> None:
    head_mb = 65536 * 128 * 4 / 2**20  # 32 MiB: the LM head, the one large MatMul weight
    done = subprocess.run([sys.executable, "-c", MEASURE, str(wide_vocabulary.path)], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr
    packed, *mapped = json.loads(done.stdout.strip().splitlines()[-1])
    assert packed > 0.75 * head_mb  # a repacking session holds a copy: the measurement sees it
    assert all(g < 0.25 * head_mb for g in mapped), (packed, mapped)

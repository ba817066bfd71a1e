"""bandpo.algo and bandpo.reward must import without ray, vllm or deepspeed."""

import subprocess
import sys

BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in {'ray', 'vllm', 'deepspeed'}:
            raise ImportError('blocked heavy import: ' + name)
sys.meta_path.insert(0, Block())
import bandpo.algo, bandpo.reward
print('ok')
"""


def test_algo_and_reward_import_without_heavy_engines():
    out = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"

"""Fill every stubbed function of a Python source in parallel, each body == greedy
after the source up to its docstring: `python -m experiments.decode
--config=configs/skeleton_fill.py` (the prompt is the source; see
`mdjax.strategies.skeleton`)."""

from configs import common

# The functions of the standard library's `secrets.py` (held out of the shipped
# models' training data) with their bodies removed.
SKELETON = '''import base64
import binascii

from hmac import compare_digest
from random import SystemRandom

_sysrand = SystemRandom()

randbits = _sysrand.getrandbits
choice = _sysrand.choice

def randbelow(exclusive_upper_bound):
    """Return a random int in the range [0, n)."""

DEFAULT_ENTROPY = 32  # number of bytes to return by default

def token_bytes(nbytes=None):
    """Return a random byte string containing *nbytes* bytes.

    If *nbytes* is ``None`` or not supplied, a reasonable
    default is used.
    """

def token_hex(nbytes=None):
    """Return a random text string, in hexadecimal.

    The string has *nbytes* random bytes, each byte converted to two
    hex digits.  If *nbytes* is ``None`` or not supplied, a reasonable
    default is used.
    """
'''


def get_config():
  """The shared fields with strategy "skeleton_fill" and a held-out skeleton."""
  config = common.get_base_config("skeleton_fill")
  config.prompt = SKELETON
  config.max_new_tokens = 40
  return config

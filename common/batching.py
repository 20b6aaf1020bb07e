# temporary shim while the scripts move to common.logprobs
from common.logprobs import *  # noqa
from common.logprobs import _response_logprobs  # noqa

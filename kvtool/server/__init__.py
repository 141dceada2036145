"""kvtool inside mlx-lm's OpenAI-compatible server.

    from kvtool.server import KVToolPromptCache
    response_generator = mlx_lm.server.ResponseGenerator(model_provider, KVToolPromptCache(prefix_cache, model_key))

`KVToolPromptCache` implements the prompt-cache protocol of `mlx_lm.server` (mlx-lm 0.32.2: the
methods of `mlx_lm.models.cache.LRUPromptCache` the server calls) on a `kvtool.PrefixCache`;
`kvtool serve` (kvtool/cli/cmd_serve_http.py) runs mlx-lm's own server with it.
"""

from kvtool.server.adapter import KVToolPromptCache
from kvtool.server.requests import RequestRecord

__all__ = ["KVToolPromptCache", "RequestRecord"]

"""2D (Optimus/SUMMA) tensor parallelism over a q x q mesh, with uneven (resizable) blocks.

``layout`` is pure (mesh positions, block sizes); ``mesh`` builds the row and column process
groups from explicit global-rank lists; ``summa`` holds the three SUMMA kernels with autograd;
``layers`` the 2D layers (linear, norms, vocab-parallel embedding, LM head and loss, batch
split/gather); ``block`` a GPT-style transformer block built from them. The plugin's path
(``parallel.tp_mode: 2d``): ``convert`` checks a Hugging Face model and converts it in place
(``hf_gpt2``, ``hf_llama``, ``hf_vit``), ``state`` gives every block its full-tensor
shard/gather hooks for checkpoints, ``policy`` is the no-op shardformer policy the engine gets.
"""

from colossal_hetero.tp2d.layout import MeshLayout, even_sizes, mesh_side
from colossal_hetero.tp2d.mesh import Mesh2D
from colossal_hetero.tp2d.summa import summa_ab, summa_abt, summa_atb

__all__ = ["Mesh2D", "MeshLayout", "even_sizes", "mesh_side", "summa_ab", "summa_abt", "summa_atb"]

import sys, traceback
import torch
sys.path.insert(0, "benchmarks")
from common import qwen35_config
from transformers import Qwen3_5ForCausalLM
from segki_lightning import RolloutEngine, SamplingConfig

name, batch, layers, mode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
over = dict(eos_token_id=None, pad_token_id=0, bos_token_id=None)
cfg = qwen35_config(name, **over)
if layers:
    cfg = qwen35_config(name, num_hidden_layers=layers, layer_types=cfg.layer_types[:layers], vocab_size=8192, **over)
torch.manual_seed(0)
with torch.device("cuda"):
    model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16).eval()
engine = RolloutEngine(model, max_batch_size=batch, max_seq_len=128 + 24, use_segki=True,
                       graph_capture=mode == "graph", eos_token_id=[])
prompts = [list(range(10, 138))]
try:
    out = engine.generate(prompts, SamplingConfig(max_new_tokens=8, temperature=0.0, n=batch))
    torch.cuda.synchronize()
    print("OK", name, batch, layers, mode, out.stats.path)
except Exception:
    traceback.print_exc()
    print("FAIL", name, batch, layers, mode)

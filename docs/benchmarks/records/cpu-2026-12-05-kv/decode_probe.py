import sys, torch
from meshserve import LLM, SamplingParams
from meshserve.bench import checkpoints
torch.set_num_threads(1)
path = checkpoints.resolve("tiny")
n, ctx = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(str(path), overrides=["parallel=single", "threads=1", "engine.block_size=16",
          f"engine.step_log={sys.argv[3]}", f"cluster={sys.argv[4]}"], progress=False)
g = torch.Generator().manual_seed(0)
prompts = [torch.randint(0, 1000, (ctx,), generator=g).tolist() for _ in range(n)]
llm.generate(prompts, SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True))
llm.shutdown()

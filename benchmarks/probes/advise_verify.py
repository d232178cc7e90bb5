"""lab.advise with verify=2 on the synthetic long-tail DAG (4 workers) and the real engines (1 + 1):
    python benchmarks/probes/advise_verify.py synthetic,hf benchmarks/results/advise.json
    python benchmarks/probes/advise_verify.py vllm benchmarks/results/advise_vllm.json
"""
import json, sys, time
import distflow_lab as lab
from distflow_lab.experiments.bench.async_schedules import long_tail_dag, real_session

lab.connect()
out = {}
for engine in sys.argv[1].split(","):
    t0 = time.time()
    s = (lab.session(long_tail_dag(workers=4), world_size=4, mode="coordinator", keep_outputs=False)
         if engine == "synthetic" else real_session(engine, "coordinator", 2, []))
    try:
        s.run(15, progress=False)
        a = lab.advise(s, max_staleness=2, skip=3, calibrate=10, verify=2)
    finally:
        s.close()
    print(engine, a, flush=True)
    out[engine] = {"table": a.table.drop(columns=["options"]).to_dict("records"),
                   "verified": a.verified.to_dict("records"), "regret": a.regret, "seconds": time.time() - t0}
json.dump(out, open(sys.argv[2], "w"), indent=1, default=float)

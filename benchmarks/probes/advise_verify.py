"""lab.advise with verify=2 on the synthetic long-tail DAG (4 workers) and the real engines (1 + 1):
    python benchmarks/probes/advise_verify.py synthetic,hf benchmarks/results/advise.json
    python benchmarks/probes/advise_verify.py vllm benchmarks/results/advise_vllm.json
and on the real pretrained model (SmolLM2-135M-Instruct, sums of 10..19 asked in prose; sizes after the workload):
    python benchmarks/probes/advise_verify.py hf,vllm benchmarks/results/advise_smollm2.json \\
        --workload smollm2-arith --record 10 --skip 2 --calibrate 6 \\
        data.prompts_per_step=4 rollout.n=4 rollout.max_response_len=32 data.options.arithmetic.max_operand=19
with micro-batch sizes as candidates too (a real engine's actor.micro_token_budget):
    python benchmarks/probes/advise_verify.py hf benchmarks/results/advise_micro.json \
        --micro-budgets 128,512,4096 --max-staleness 1 --verify 3
"""
import argparse, json, time
import distflow_lab as lab
from distflow_lab.experiments.bench.async_schedules import long_tail_dag, real_session

p = argparse.ArgumentParser()
p.add_argument("engines")
p.add_argument("json_path")
p.add_argument("--workload", default="longtail", help="the real engines' workload (async_schedules.WORKLOADS)")
p.add_argument("--record", type=int, default=15, help="sync updates recorded")
p.add_argument("--skip", type=int, default=3, help="warm-up updates the replay leaves out")
p.add_argument("--calibrate", type=int, default=10)
p.add_argument("--max-staleness", type=int, default=2)
p.add_argument("--verify", type=int, default=2)
p.add_argument("--micro-budgets", default="", help="comma-separated actor.micro_token_budget candidates (real engines)")
p.add_argument("overrides", nargs="*", help="the real engines' preset overrides")
a = p.parse_intermixed_args()

lab.connect()
out = {"args": vars(a)}
for engine in a.engines.split(","):
    t0 = time.time()
    s = (lab.session(long_tail_dag(workers=4), world_size=4, mode="coordinator", keep_outputs=False)
         if engine == "synthetic" else real_session(engine, "coordinator", 2, a.overrides, workload=a.workload))
    try:
        s.run(a.record, progress=False)
        budgets = [int(b) for b in a.micro_budgets.split(",") if b] if engine != "synthetic" else []
        adv = lab.advise(s, max_staleness=a.max_staleness, skip=a.skip, calibrate=a.calibrate, verify=a.verify,
                         micro_token_budgets=budgets or None)
    finally:
        s.close()
    print(engine, adv, flush=True)
    out[engine] = {"table": adv.table.drop(columns=["options"]).to_dict("records"),
                   "verified": adv.verified.to_dict("records"), "regret": adv.regret, "notes": adv.notes,
                   "seconds": time.time() - t0}
    json.dump(out, open(a.json_path, "w"), indent=1, default=float)

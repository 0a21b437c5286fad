# Rewrites citations of documents outside this repository (REFERENCE.md, DESIGN.md, PITFALLS.md)
# into citations of the papers and of docs/ in this repository.
# Apply from the repository root:
#   grep -rlE "REFERENCE\.md|DESIGN\.md|PITFALLS" --include=*.py --include=*.yaml engine policies testbed tests workloads \
#     | xargs sed -i -f cite.sed
# then check: grep -rnE "REFERENCE\.md|DESIGN\.md|PITFALLS" --include=*.py --include=*.yaml . (expect nothing)

# --- policy module docstrings: paper + the policy's section of docs/policies.md -----------------
s/(REFERENCE\.md section 1)/(OSDI'24; docs\/policies.md#sarathi)/
s/(REFERENCE\.md section 2)/(SOSP'23; docs\/policies.md#vllm)/
s/(SC'25; REFERENCE\.md section 3)/(SC'25; docs\/policies.md#gllm)/
s/(ICPP'25; REFERENCE\.md section 4)/(ICPP'25; docs\/policies.md#tdpipe)/
s/TD-Pipe's KV planning (REFERENCE\.md section 4)/TD-Pipe's KV planning (ICPP'25; docs\/policies.md#tdpipe)/
s/CPU-assisted pipeline runtime (REFERENCE\.md section 5)/CPU-assisted pipeline runtime (arXiv 2506.22033; docs\/policies.md#sipipe)/
s/slow links between stages (REFERENCE\.md section 6)/slow links between stages (MoLink, 2025; docs\/policies.md#molink)/

# --- hardware tables ---------------------------------------------------------------------------
s/cost model (REFERENCE\.md section 7)\./cost model (the papers' setups: docs\/policies.md#references)./
s/both measured figures quoted in REFERENCE\.md section 7\./both measured figures of TD-Pipe's setting (ICPP'25)./
s/# REFERENCE\.md s7: measured \(PCIe [^(]*[^ (]\) (TD-Pipe setting)/# measured \1 in TD-Pipe's setting (ICPP'25)/

# --- cost model and profiling ----------------------------------------------------------------
s/(DESIGN\.md, "The simulator")/(docs\/calibration.md)/
s/ a\*(2\*L\*x + x^2) (PITFALLS\.md):/ a*(2*L*x + x^2) (docs\/calibration.md):/
s/underestimate a pipelined run badly (PITFALLS)\./underestimate a pipelined run badly (docs\/calibration.md)./

# --- Optuna / MLflow facts: the public issues they come from ------------------------------------
s/`alembic_version` table, PITFALLS\.md)/`alembic_version` table: mlflow issue 3374)/
s/optuna issue 820 \/ PITFALLS\.md)/optuna issue 820)/
s/thread-local; PITFALLS\.md)/thread-local since mlflow PR 13456)/
s/thread-local, PITFALLS\.md)/thread-local since mlflow PR 13456)/
s/^PITFALLS\.md), copying the result/measured), copying the result/

# --- reproduction studies: the paper itself ----------------------------------------------------
s/^reference: "REFERENCE\.md section 4 (switch rules, work stealing, Headline)"/reference: "its switch rules, work stealing and headline results (docs\/policies.md#tdpipe)"/
s/^reference: "REFERENCE\.md section 4 (Headline, Setup)"/reference: "its headline results and setup (docs\/policies.md#tdpipe)"/
s/^reference: "REFERENCE\.md section 3 (Headline, Metrics, Workloads) and section 1 (the baseline)"/reference: "its headline results, metrics and workloads, with Sarathi-Serve (OSDI'24) as the baseline (docs\/policies.md#gllm)"/
s/^reference: "REFERENCE\.md section 3 (hyperparameters and sensitivity)"/reference: "its hyperparameters and sensitivity study (docs\/policies.md#gllm)"/
s/^reference: "REFERENCE\.md section 5 (Headline, Ablation)"/reference: "its headline results and ablation (docs\/policies.md#sipipe)"/
s/^reference: "REFERENCE\.md section 6 (Headline)"/reference: "its headline results (docs\/policies.md#molink)"/
s/^\(#.*\)(REFERENCE\.md section 3)/\1(gLLM, SC'25)/
s/^\(#.*\)(REFERENCE\.md section 4)/\1(TD-Pipe, ICPP'25)/
s/^\(#.*\)(REFERENCE\.md section 5)/\1(SiPipe, arXiv 2506.22033)/
s/^\(#.*\)(REFERENCE\.md section 6)/\1(MoLink, 2025)/
s/REFERENCE\.md gives a number for work stealing only/The paper gives a number for work stealing only/
s/the ranges REFERENCE\.md names\. REFERENCE\.md states a number/the ranges the paper studies. The paper states a number/
s/what REFERENCE\.md states, each computed/what the paper states, each computed/
s/the claim as REFERENCE\.md states it/the claim as the paper states it/
s/published (REFERENCE\.md)/published (paper)/

/* kvm_sculpt_settings.h: THE list of KVSculpt settings, one X-macro row each. It is expanded
 * by compress/sculpt/sculpt_opts.c (flags `kvmill sculpt|eval --NAME`, method option strings
 * `sculpt:NAME=VALUE`) and by pipeline/kvm_config_table.c (the [compress] keys), so one setting
 * has one name everywhere: the config key is NAME, the flag is NAME with '-' for '_' (both
 * spellings are accepted in option strings). No include guard: include it only after defining
 *
 *   KVM_SCULPT_SETTING(name, kind, field, lo, hi, in_config, def, unit, help, replaced_by)
 *
 * name        identifier: the setting's name
 * kind        I64, INT, U64 (integers), F64 (number), BOOL (flag), MODE, ALLOC, QSOURCE (words), BUDGET
 *             (entries per KV head including the retain zone: k = value − retain), DEVICE (cpu or
 *             cuda:N: sets cuda and cuda_device)
 * field       the kvm_sculpt_opts member it sets (compress/sculpt/kvm_sculpt.h)
 * lo, hi      bounds of numeric values
 * in_config   1: a [compress] key generated from this row, and a setting PolyKV strategy files and
 *             signals CSVs record (kvm_sculpt_opts_canonical, with method and future); 0: not
 *             one (method, ratio, budget and
 *             future are [compress] keys of their own, shared with eviction or the stages;
 *             threads is [stages] threads, device the compress worker's --device from [stages]
 *             compress_devices; deprecated names are no keys)
 * def         the default as text, equal to kvm_sculpt_opts_default() (a test checks)
 * unit        "tokens", "queries", ... or ""
 * help        one line, without the default
 * replaced_by NULL, or the name that replaces this deprecated one (still accepted, with a
 *             warning in the command line) */

KVM_SCULPT_SETTING(method, MODE, mode, 0, 0, 0, "sculpt", "", "sculpt | selectfit | joint-fixed | am | kvzip", NULL)
KVM_SCULPT_SETTING(retain, I64, retain_tokens, 0, 1 << 30, 1, "32", "tokens",
                   "retain zone m: the last context tokens kept unchanged", NULL)
KVM_SCULPT_SETTING(ratio, F64, ratio, 1e-9, 1, 0, "0.3", "", "r = k/(N-m): distilled entries per compress-zone token", NULL)
KVM_SCULPT_SETTING(budget, BUDGET, k_entries, 0, 1 << 20, 0, "0", "entries",
                   "b entries per KV head including the retain zone (k = b - m distilled), instead of ratio: give one "
                   "of them; 0 (or -0) = "
                   "use ratio",
                   NULL)
KVM_SCULPT_SETTING(entries, I64, k_entries, 0, 1 << 30, 0, "0", "entries",
                   "k distilled entries per KV head; budget = entries + retain", "budget")
KVM_SCULPT_SETTING(queries, I64, n_synth, 0, 1 << 24, 1, "2048", "queries", "S training queries per KV head besides the retain zone's (split by query_source)", NULL)
KVM_SCULPT_SETTING(query_source, QSOURCE, query_source, 0, 0, 1, "synthetic", "",
                   "where the training queries come from: synthetic | repeat (the context repeated after a prompt) | "
                   "continuation (greedy tokens after it), or a mix NAME@SHARE+NAME@SHARE of the queries count", NULL)
KVM_SCULPT_SETTING(on_policy, BOOL, on_policy, 0, 1, 1, "false", "",
                   "compress layer by layer, each layer's repeat/continuation queries from a forward pass over the "
                   "layers below already compressed (Attention Matching's on-policy mode)", NULL)
KVM_SCULPT_SETTING(synthetic_queries, I64, n_synth, 0, 1 << 24, 0, "2048", "queries",
                   "S synthetic future queries per KV head", "queries")
KVM_SCULPT_SETTING(future, I64, future_tokens, 0, 1 << 20, 0, "0", "tokens",
                   "F: synthetic query positions N + floor(i*F/S); 0 = the continuation length (eval's "
                   "--continuation; sculpt has none: 64), a flag's meaning only: [compress] future, with no "
                   "continuation in a run, is 1 or more",
                   NULL)
KVM_SCULPT_SETTING(lambda, F64, lambda, 0, 1e6, 1, "0.1", "", "weight of the LSE-matching term", NULL)
KVM_SCULPT_SETTING(lse_weight, BOOL, lse_mass_weight, 0, 1, 1, "false", "",
                   "weight each query's LSE error by the compress zone's attention share (ours)", NULL)
KVM_SCULPT_SETTING(ridge, F64, ridge_alpha, 1e-12, 1e6, 1, "0.001", "",
                   "ridge alpha of the value fit, relative to the mean diagonal of the normal matrix", NULL)
KVM_SCULPT_SETTING(ridge_f32, INT, ridge_f32, 0, 1, 1, "1", "",
                   "1: the ridge's normal equations by kvmill's float32 GEMM (float64 block sums; float64 where the "
                   "Cholesky shows them ill-conditioned); 0 = float64 (OpenBLAS), the fit before it", NULL)
KVM_SCULPT_SETTING(alpha, F64, ridge_alpha, 1e-12, 1e6, 0, "0.001", "", "ridge alpha", "ridge")
KVM_SCULPT_SETTING(vcap, F64, vnorm_cap, 0, 1e6, 1, "1", "", "value-norm guard: |v| <= vcap * max zone |v|; 0 = off", NULL)
KVM_SCULPT_SETTING(kcap, F64, knorm_cap, 0, 1e6, 1, "0", "",
                   "key-norm guard: |k| <= kcap * max zone |k| after each L-BFGS round; 0 = off", NULL)
KVM_SCULPT_SETTING(rounds, INT, rounds, 0, 1000, 1, "4", "", "alternating key/value rounds R", NULL)
KVM_SCULPT_SETTING(iterations, INT, lbfgs_iters, 0, 100000, 1, "25", "", "L-BFGS iterations per round", NULL)
KVM_SCULPT_SETTING(iters, INT, lbfgs_iters, 0, 100000, 0, "25", "", "L-BFGS iterations per round", "iterations")
KVM_SCULPT_SETTING(history, INT, lbfgs_history, 1, 1000, 1, "20", "", "L-BFGS memory", NULL)
KVM_SCULPT_SETTING(tolerance, F64, lbfgs_tolerance, 0, 1, 1, "0", "",
                   "L-BFGS convergence stop: a round's run ends when its last 4 iterations gained less than this "
                   "share of its decrease so far; 0 = off", NULL)
KVM_SCULPT_SETTING(gradient_tolerance, F64, lbfgs_gtol, 0, 1, 1, "0", "",
                   "L-BFGS gradient stop relative to the problem: a run ends when |g| <= this * |g| at the start of "
                   "the problem's first round; 0 = off (the absolute rule |g| <= 1e-6 max(1, |x|), the solve before it)",
                   NULL)
KVM_SCULPT_SETTING(carry_history, INT, carry_history, 0, 1, 1, "1", "",
                   "1: each alternating round's L-BFGS starts with the previous round's memory; 0 = off (an empty one, "
                   "the solve before it)", NULL)
KVM_SCULPT_SETTING(round_tolerance, F64, round_tolerance, 0, 1, 1, "0.2", "",
                   "a (layer, KV head) problem leaves the rounds when a round improved its best loss by less than "
                   "this fraction; 0 = off (every round runs, the solve before it)", NULL)
KVM_SCULPT_SETTING(bias, BOOL, bias, 0, 1, 1, "false", "",
                   "a logit bias beta per distilled entry, fitted with the keys (Attention Matching)", NULL)
KVM_SCULPT_SETTING(am_start, BOOL, am_start, 0, 1, 1, "false", "",
                   "start each problem from Attention Matching's keys, beta and values (the am method) instead of "
                   "Select+Fit's (sculpt, joint-fixed; selectfit then keeps am's keys)", NULL)
KVM_SCULPT_SETTING(alloc, ALLOC, alloc, 0, 0, 1, "uniform", "",
                   "KVSculpt budget allocation over layers/heads: uniform | layer | head (pilot MSE^p, paper) | "
                   "gain (marginal-gain water-filling)", NULL)
KVM_SCULPT_SETTING(power, F64, alloc_power, 0, 100, 1, "0.5", "", "p of the MSE^p allocation rule", NULL)
KVM_SCULPT_SETTING(pilot_rounds, INT, pilot_rounds, 0, 1000, 1, "0", "",
                   "alternating rounds of the allocation pilot (0: the Select+Fit start's MSE)", NULL)
KVM_SCULPT_SETTING(pilot_iterations, INT, pilot_iters, 0, 100000, 1, "10", "", "L-BFGS iterations per pilot round", NULL)
KVM_SCULPT_SETTING(pilot_iters, INT, pilot_iters, 0, 100000, 0, "10", "", "L-BFGS iterations per pilot round",
                   "pilot_iterations")
KVM_SCULPT_SETTING(seed, U64, seed, 0, 9007199254740992.0, 1, "1", "", "seed of the synthetic queries", NULL)
KVM_SCULPT_SETTING(threads, INT, threads, 1, 256, 0, "1", "",
                   "compute threads: the solver's worker threads over (layer, KV head) problems, and the prefill's", NULL)
KVM_SCULPT_SETTING(device, DEVICE, cuda_device, 0, 255, 0, "cpu", "",
                   "the solver's device, cpu or cuda:N (refused at once where there is no such device): the batched "
                   "L-BFGS loss, gradients and ridge normal equations run there; the prefill, am, kvzip and the "
                   "liblbfgs oracle run on the CPU", NULL)

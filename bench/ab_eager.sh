# bench/ab_eager.sh -- sourced by bench/blas_ab.sh and bench/amx_ab.sh: the
# rounds of A B B A over bench-eager and their summary.
#
# The sourcing script sets $bin (bench-eager), $tmp (a scratch folder) and
# defines run_arm A|B FLAGS..., which runs one process with its output in
# $tmp/out; ab_rounds ROUNDS FLAGS... then runs the rounds, prints per run
# the CPU time per step (median) and the GEMM op time per step (the
# process runs with EPJIT_PROFILE=1), and each arm's medians, spread and
# B / A.
ab_arm() {
	a=$1
	shift
	run_arm "$a" "$@" || { cat "$tmp/out" >&2; exit 1; }
	cpu=$(sed -n 's/.*CPU time \/ step, median (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	gemm=$(sed -n 's/.*GEMM ops \/ step (ms) *| *\([0-9.]*\).*/\1/p' "$tmp/out")
	echo "$a ${cpu:-?} ${gemm:-?}" | tee -a "$tmp/rows"
}

ab_rounds() {
	rounds=$1
	shift
	: >"$tmp/rows"
	echo "arm cpu_ms_per_step gemm_ms_per_step"
	r=0
	while [ "$r" -lt "$rounds" ]; do
		r=$((r + 1))
		ab_arm A "$@"
		ab_arm B "$@"
		ab_arm B "$@"
		ab_arm A "$@"
	done
	awk '
function med(v, n,   i, j, t) {
	for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++)
		if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
	return n % 2 ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
}
function spread(v, n,   i, lo, hi) {
	lo = hi = v[1]
	for (i = 2; i <= n; i++) { if (v[i] < lo) lo = v[i]; if (v[i] > hi) hi = v[i] }
	return sprintf("%.1f-%.1f", lo, hi)
}
{ if ($1 == "A") { ca[++na] = $2; ga[na] = $3 } else { cb[++nb] = $2; gb[nb] = $3 } }
END {
	sa = spread(ca, na); sb = spread(cb, nb)
	mca = med(ca, na); mcb = med(cb, nb); mga = med(ga, na); mgb = med(gb, nb)
	printf "median CPU ms/step: A %.1f (%s)  B %.1f (%s)  B/A %.3f\n", mca, sa, mcb, sb, mcb / mca
	if (mga > 0)
		printf "median GEMM op ms/step: A %.1f  B %.1f  B/A %.3f\n", mga, mgb, mgb / mga
}' "$tmp/rows"
}

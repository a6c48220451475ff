/* t/tb_check.c -- checks an epjit-train TensorBoard event file against the
 * csv_monitor files of the same run (t/tensorboard.sh).
 *
 *   tb_check EVENTS CSV_DIR   exit 0 when they agree, 1 (with the reason)
 *                             when not, 2 on bad usage
 *   tb_check --dump EVENTS    one line per event: step, tag, value
 *
 * EVENTS is read with t/tb_reader.c (framing, both CRCs, the Event
 * fields).  The first event must be the file_version "brain.Event:2" one,
 * every other one a scalar of a tag of DeepSpeed's Train/Samples/ list
 * below or of an expert-load tag, Train/Samples/<load name>_layer_<N>.
 * For each tag, its events must be the rows of CSV_DIR's
 * Train_Samples_<metric>.csv in order: the same steps, and values equal
 * after rounding the CSV's (9 significant digits) to float, within one
 * float ulp (the two roundings may differ by one).  The events of one step
 * share a wall_time, which is a plausible Unix time.
 */
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tb_reader.h"

/* Written out here, not taken from the trainer. */
static const char *const metrics[] = {
	"train_loss",	       "lr",
	"grad_norm",	       "tokens_per_s",
	"step_time_ms",	       "peak_alloc_bytes",
	"compile_ms",	       "peak_alloc_rank",
	"peak_reserved_bytes", "peak_reserved_rank"
};
#define N_FIXED (int)(sizeof metrics / sizeof metrics[0])
/* The expert-load metrics, per MoE layer (<name>_layer_<N>). */
static const char *const load_names[] = { "moe_load_max_mean", "moe_load_cv",
					  "moe_dead_experts" };
/* The metrics checked: the fixed ones, then the load tags the file has. */
enum { MAX_METRICS = 4096 };
static char names[MAX_METRICS][96];
static int n_names;

/* Whether m ("moe_load_cv_layer_12") is an expert-load metric. */
static bool load_metric_p(const char *m)
{
	for (size_t i = 0; i < sizeof load_names / sizeof load_names[0]; i++) {
		size_t n = strlen(load_names[i]);
		const char *d = m + n + strlen("_layer_");
		if (!strncmp(m, load_names[i], n) &&
		    !strncmp(m + n, "_layer_", strlen("_layer_")) && *d &&
		    strspn(d, "0123456789") == strlen(d))
			return true;
	}
	return false;
}

static int bad(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* Prints "tb_check: <message>" and returns 1. */
static int bad(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fprintf(stderr, "tb_check: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
	return 1;
}

static int metric_of(const char *tag)
{
	static const char prefix[] = "Train/Samples/";
	if (strncmp(tag, prefix, sizeof prefix - 1))
		return -1;
	for (int i = 0; i < n_names; i++)
		if (!strcmp(tag + sizeof prefix - 1, names[i]))
			return i;
	return -1;
}

/* names: the fixed metrics, then every expert-load tag of the events. */
static void collect_names(const tbr_event *ev, int n)
{
	static const char prefix[] = "Train/Samples/";
	for (n_names = 0; n_names < N_FIXED; n_names++)
		snprintf(names[n_names], sizeof names[0], "%s",
			 metrics[n_names]);
	for (int i = 0; i < n; i++) {
		const char *t = ev[i].has_value ? ev[i].tag : "";
		if (strncmp(t, prefix, sizeof prefix - 1) ||
		    !load_metric_p(t + sizeof prefix - 1) ||
		    metric_of(t) >= 0 || n_names == MAX_METRICS ||
		    strlen(t) >= sizeof names[0] + sizeof prefix - 1)
			continue;
		snprintf(names[n_names++], sizeof names[0], "%s",
			 t + sizeof prefix - 1);
	}
}

/* The events of metric m against its CSV file. */
static int check_metric(const tbr_event *ev, int n, int m, const char *dir,
			const char *events)
{
	char path[4096], line[256], header[sizeof names[0] + 8];
	snprintf(path, sizeof path, "%s/Train_Samples_%.95s.csv", dir,
		 names[m]);
	FILE *f = fopen(path, "r");
	if (!f)
		return bad("%s: cannot open", path);
	snprintf(header, sizeof header, "step,%.95s\n", names[m]);
	if (!fgets(line, sizeof line, f) || strcmp(line, header)) {
		fclose(f);
		return bad("%s: bad header", path);
	}
	int k = 1, rows = 0;
	while (fgets(line, sizeof line, f)) {
		long long step;
		double v;
		if (sscanf(line, "%lld,%lf", &step, &v) != 2) {
			fclose(f);
			return bad("%s: bad row %d: %s", path, rows + 1, line);
		}
		rows++;
		while (k < n && metric_of(ev[k].tag) != m)
			k++;
		if (k == n) {
			fclose(f);
			return bad("%s: no event for row %d of %s", events,
				   rows, path);
		}
		float want = (float)v, got = ev[k].value;
		float aw = fabsf(want);
		double ulp = aw == 0 ? 0 : nextafterf(aw, INFINITY) - aw;
		if (ev[k].step != step ||
		    !(fabs((double)got - (double)want) <= ulp)) {
			fprintf(stderr,
				"tb_check: %s: %s at step %lld is %.9g; %s "
				"has %lld,%.9g\n",
				events, ev[k].tag, (long long)ev[k].step,
				(double)got, path, step, v);
			fclose(f);
			return 1;
		}
		k++;
	}
	fclose(f);
	while (k < n && metric_of(ev[k].tag) != m)
		k++;
	if (k < n)
		return bad("%s: more %s events than the %d rows of %s", events,
			   names[m], rows, path);
	if (rows == 0)
		return bad("%s: no rows", path);
	return 0;
}

int main(int argc, char **argv)
{
	bool dump = argc == 3 && !strcmp(argv[1], "--dump");
	if (argc != 3) {
		fprintf(stderr, "usage: tb_check EVENTS CSV_DIR | --dump "
				"EVENTS\n");
		return 2;
	}
	const char *events = dump ? argv[2] : argv[1];
	char err[4352];
	tbr_event *ev;
	int n = tbr_read(events, &ev, err, sizeof err);
	if (n < 0) {
		fprintf(stderr, "tb_check: %s\n", err);
		return 1;
	}
	if (dump) {
		for (int i = 0; i < n; i++) {
			if (ev[i].has_version)
				printf("%lld version %s\n",
				       (long long)ev[i].step, ev[i].version);
			if (ev[i].has_value)
				printf("%lld %s %.9g\n", (long long)ev[i].step,
				       ev[i].tag, (double)ev[i].value);
		}
		free(ev);
		return 0;
	}
	int rc = 0;
	double now = (double)time(NULL);
	collect_names(ev, n);
	if (n < 1 || !ev[0].has_version || ev[0].has_value ||
	    strcmp(ev[0].version, "brain.Event:2") || ev[0].step != 0)
		rc = bad("%s: the first event is not file_version "
			 "brain.Event:2 (%d events)",
			 events, n);
	for (int i = 0; i < n && !rc; i++) {
		/* 2017-07-14 .. now (+1 s) */
		if (!(ev[i].wall_time > 1.5e9 && ev[i].wall_time <= now + 1))
			rc = bad("%s: event %d: wall_time %.17g is not a Unix "
				 "time",
				 events, i, ev[i].wall_time);
		else if (i > 0 && (ev[i].has_version || !ev[i].has_value ||
				   metric_of(ev[i].tag) < 0))
			rc = bad("%s: event %d is not a scalar of a "
				 "Train/Samples/ metric",
				 events, i);
		else if (i > 1 && ev[i].step == ev[i - 1].step &&
			 ev[i].wall_time != ev[i - 1].wall_time)
			rc = bad("%s: the events of one step differ in "
				 "wall_time (event %d)",
				 events, i);
		else if (i > 1 && ev[i].step < ev[i - 1].step)
			rc = bad("%s: steps go back (event %d)", events, i);
	}
	for (int m = 0; m < n_names && !rc; m++)
		rc = check_metric(ev, n, m, argv[2], events);
	if (!rc)
		printf("tb_check: %s: %d scalars of %d metrics agree with %s\n",
		       events, n - 1, n_names, argv[2]);
	free(ev);
	return rc;
}

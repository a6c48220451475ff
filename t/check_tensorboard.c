/* check_tensorboard.c -- the trainer's TensorBoard event writer
 * (tools/tb_events.c).
 *
 * References, none of them the writer itself: published CRC-32C vectors
 * (RFC 3720) and TensorBoard's masked_crc32c of "123456789"; a golden file
 * written by TensorBoard's own protobuf classes and record writer
 * (t/golden/tb_read.py golden, which also reads it back with TensorBoard's
 * EventAccumulator); and the independent reader t/tb_reader.c (bitwise
 * CRC, generic protobuf decoding) for random events, damaged files and the
 * file name.  t/tensorboard.sh checks the trainer's file of a real run
 * against its csv_monitor files.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../tools/tb_events.h"
#include "check_util.h"
#include "tb_reader.h"

Suite *make_tensorboard_suite(void);

static unsigned char *slurp(const char *path, size_t *n)
{
	FILE *f = fopen(path, "rb");
	ck_assert_msg(f != NULL, "%s: %s", path, strerror(errno));
	ck_assert_int_eq(fseek(f, 0, SEEK_END), 0);
	long len = ftell(f);
	ck_assert_int_ge(len, 0);
	rewind(f);
	unsigned char *b = malloc((size_t)len + 1);
	ck_assert_ptr_nonnull(b);
	ck_assert_uint_eq(fread(b, 1, (size_t)len, f), (size_t)len);
	fclose(f);
	*n = (size_t)len;
	return b;
}

/* CRC-32C against published vectors, the masking against TensorBoard's
 * value and its definition, and the writer's table against the reader's
 * bitwise CRC on random buffers. */
START_TEST(test_crc32c)
{
	static const struct {
		const char *name;
		unsigned char fill; /* 32 bytes of it, or 0..31 when 0xAA */
		uint32_t crc;
	} rfc[] = { { "zeros", 0x00, 0x8A9136AAu },
		    { "ones", 0xFF, 0x62A8AB43u },
		    { "incrementing", 0xAA, 0x46DD794Eu } };
	unsigned char b[32];
	for (size_t i = 0; i < sizeof rfc / sizeof rfc[0]; i++) {
		for (int k = 0; k < 32; k++)
			b[k] = rfc[i].fill == 0xAA ? (unsigned char)k
						   : rfc[i].fill;
		ck_assert_msg(tb_crc32c(b, 32) == rfc[i].crc,
			      "crc32c(%s) = %08x, want %08x", rfc[i].name,
			      tb_crc32c(b, 32), rfc[i].crc);
		ck_assert_uint_eq(tbr_crc32c(b, 32), rfc[i].crc);
	}
	ck_assert_uint_eq(tb_crc32c("123456789", 9), 0xE3069283u);
	ck_assert_uint_eq(tb_crc32c("", 0), 0);
	/* TensorBoard's masked_crc32c(b"123456789") and of b"" */
	ck_assert_uint_eq(tb_crc_mask(0xE3069283u), 0xC78AB0E5u);
	ck_assert_uint_eq(tb_crc_mask(0), 0xA282EAD8u);
	/* masked_crc32c of a zero length field (8 zero bytes) */
	memset(b, 0, 8);
	ck_assert_uint_eq(tb_crc_mask(tb_crc32c(b, 8)), 0x07980329u);
	unsigned char r[1000];
	for (int t = 0; t < 50; t++) {
		size_t n = (size_t)tu_randint(0, (int64_t)sizeof r + 1);
		for (size_t i = 0; i < n; i++)
			r[i] = (unsigned char)tu_randint(0, 256);
		uint32_t c = tb_crc32c(r, n);
		ck_assert_uint_eq(c, tbr_crc32c(r, n));
		ck_assert_uint_eq(tb_crc_mask(c), tbr_mask(c));
		/* the mask is a rotation plus a constant: never the
		 * identity on these, and undone by its inverse */
		uint32_t m = tb_crc_mask(c) - 0xA282EAD8u;
		ck_assert_uint_eq((m >> 17) | (m << 15), c);
	}
}
END_TEST

/* The events of t/golden/tb_read.py's FIXED list, same order. */
#define VERSION_WALL 1700000000.25
static void write_fixed(tb_writer *w, char *long_tag)
{
	memset(long_tag, 'x', 164);
	memcpy(long_tag, "Train/Samples/", 14);
	long_tag[164] = '\0';
	static const struct {
		double wall;
		int64_t step;
		const char *tag;
		double value;
	} ev[] = {
		{ 1700000001.5, 6, "Train/Samples/train_loss", 2.5 },
		{ 1700000001.5, 6, "Train/Samples/lr", 0.001 },
		{ 1700000001.5, 6, "Train/Samples/compile_ms", 0.0 },
		{ 1700000002.125, 12, "Train/Samples/grad_norm", -1.25 },
		{ 1700000002.125, 0, "Train/Samples/tokens_per_s", 123456.789 },
		{ 1700000002.125, (int64_t)1 << 40,
		  "Train/Samples/peak_alloc_bytes", 3.0e38 },
		{ 1700000003.0, 128, NULL, 1.5 },
	};
	for (size_t i = 0; i < sizeof ev / sizeof ev[0]; i++)
		ck_assert_int_eq(
		    tb_writer_scalar(w, ev[i].wall, ev[i].step,
				     ev[i].tag ? ev[i].tag : long_tag,
				     (float)ev[i].value),
		    0);
}

/* The writer's bytes are TensorBoard's own for the same events (wall
 * times included: they are fixed here), and the independent reader sees
 * the same events. */
START_TEST(test_golden_bytes)
{
	char *dir = tu_tmpdir_new("tb");
	char path[512], golden[4096], err[512], long_tag[165];
	snprintf(path, sizeof path, "%s/events", dir);
	tb_writer *w = tb_writer_open_path(path, VERSION_WALL, err, sizeof err);
	ck_assert_msg(w != NULL, "%s", err);
	write_fixed(w, long_tag);
	ck_assert_int_eq(tb_writer_close(w), 0);
	snprintf(golden, sizeof golden, "%s/t/golden/tb_scalars.tfevents",
		 tu_srcdir());
	size_t n, gn;
	unsigned char *b = slurp(path, &n), *g = slurp(golden, &gn);
	for (size_t i = 0; i < n && i < gn; i++)
		ck_assert_msg(b[i] == g[i],
			      "byte %zu: %02x, TensorBoard wrote %02x", i, b[i],
			      g[i]);
	ck_assert_uint_eq(n, gn);
	tbr_event *ev;
	int m = tbr_read(path, &ev, err, sizeof err);
	ck_assert_msg(m == 8, "%d events: %s", m, err);
	ck_assert(ev[0].has_version && !ev[0].has_value);
	ck_assert_str_eq(ev[0].version, "brain.Event:2");
	ck_assert(ev[0].wall_time == VERSION_WALL);
	ck_assert_str_eq(ev[5].tag, "Train/Samples/tokens_per_s");
	ck_assert_int_eq(ev[5].step, 0);
	ck_assert(ev[5].value == (float)123456.789);
	ck_assert_int_eq(ev[6].step, (int64_t)1 << 40);
	ck_assert_str_eq(ev[7].tag, long_tag);
	ck_assert(ev[3].has_value && ev[3].value == 0.0f);
	free(ev);
	free(b);
	free(g);
	tu_tmpdir_free(dir);
}
END_TEST

/* Random events round-trip through the reader exactly; any flipped byte
 * or cut file is refused by it (both CRCs guard the records). */
START_TEST(test_random_round_trip)
{
	char *dir = tu_tmpdir_new("tb");
	char path[512], err[512];
	snprintf(path, sizeof path, "%s/events", dir);
	double wall0 = 1.7e9 + tu_uniform(0, 1e8);
	tb_writer *w = tb_writer_open_path(path, wall0, err, sizeof err);
	ck_assert_msg(w != NULL, "%s", err);
	enum { N = 60 };
	static char tags[N][200];
	int64_t steps[N];
	float vals[N];
	double walls[N];
	for (int i = 0; i < N; i++) {
		int len = (int)tu_randint(1, 199);
		for (int k = 0; k < len; k++)
			tags[i][k] = (char)tu_randint(32, 127);
		tags[i][len] = '\0';
		/* 0, small, around varint boundaries, and huge steps */
		int64_t pick = tu_randint(0, 4);
		steps[i] = pick == 0   ? 0
			   : pick == 1 ? tu_randint(1, 300)
			   : pick == 2 ? tu_randint(16000, 17000)
				       : tu_randint(1, INT64_MAX / 4) * 3;
		vals[i] = (float)(tu_uniform(-1, 1) *
				  pow(10.0, (double)tu_randint(-30, 30)));
		walls[i] = wall0 + tu_uniform(0, 1e5);
		ck_assert_int_eq(
		    tb_writer_scalar(w, walls[i], steps[i], tags[i], vals[i]),
		    0);
		if (i % 7 == 0)
			ck_assert_int_eq(tb_writer_flush(w), 0);
	}
	ck_assert_int_eq(tb_writer_close(w), 0);
	tbr_event *ev;
	int m = tbr_read(path, &ev, err, sizeof err);
	ck_assert_msg(m == N + 1, "%d events: %s", m, err);
	ck_assert(ev[0].wall_time == wall0);
	for (int i = 0; i < N; i++) {
		const tbr_event *e = &ev[i + 1];
		ck_assert(e->has_value && !e->has_version);
		ck_assert_str_eq(e->tag, tags[i]);
		ck_assert_int_eq(e->step, steps[i]);
		ck_assert(memcmp(&e->value, &vals[i], sizeof(float)) == 0);
		ck_assert(e->wall_time == walls[i]);
	}
	free(ev);
	/* damage: one flipped bit anywhere, or a cut anywhere */
	size_t n;
	unsigned char *b = slurp(path, &n);
	char bad[600];
	snprintf(bad, sizeof bad, "%s/bad", dir);
	for (int t = 0; t < 40; t++) {
		bool flip = t % 2 == 0;
		size_t at = (size_t)tu_randint(0, (int64_t)n);
		unsigned char bit = (unsigned char)(1u << tu_randint(0, 8));
		FILE *f = fopen(bad, "wb");
		ck_assert_ptr_nonnull(f);
		if (flip)
			b[at] ^= bit;
		size_t len = flip ? n : at;
		ck_assert_uint_eq(fwrite(b, 1, len, f), len);
		fclose(f);
		if (flip)
			b[at] ^= bit;
		/* a cut between two records is a shorter valid file */
		int got = tbr_read(bad, &ev, err, sizeof err);
		if (got >= 0) {
			ck_assert_msg(!flip, "flipped byte %zu read as valid",
				      at);
			ck_assert_int_lt(got, N + 1);
			free(ev);
		} else {
			ck_assert_ptr_nonnull(strstr(err, bad));
		}
	}
	free(b);
	tu_tmpdir_free(dir);
}
END_TEST

/* The number n of a file name dir/events.out.tfevents.<10-digit Unix time
 * in [t0, t1]>.<host>.<pid>.<n>, as TensorBoard names its files; -1 when
 * the name is not that. */
static long name_number(const char *path, const char *dir, long long t0,
			long long t1)
{
	char host[256] = "", want[1024];
	ck_assert_int_eq(gethostname(host, sizeof host), 0);
	host[sizeof host - 1] = '\0';
	const char *dot = strrchr(path, '.');
	ck_assert_ptr_nonnull(dot);
	long n = strtol(dot + 1, NULL, 10);
	for (long long t = t0; t <= t1; t++) {
		snprintf(want, sizeof want,
			 "%s/events.out.tfevents.%010lld.%s.%ld.%ld", dir, t,
			 host, (long)getpid(), n);
		if (!strcmp(path, want))
			return n;
	}
	return -1;
}

/* tb_writer_open names the file as TensorBoard does, n counting the files
 * this process opened; each file starts with the version event, flushed
 * at open. */
START_TEST(test_file_name)
{
	char *dir = tu_tmpdir_new("tb");
	char err[512];
	long long t0 = (long long)time(NULL);
	tb_writer *a = tb_writer_open(dir, 1.7e9, err, sizeof err);
	ck_assert_msg(a != NULL, "%s", err);
	tb_writer *b = tb_writer_open(dir, 1.7e9, err, sizeof err);
	ck_assert_msg(b != NULL, "%s", err);
	long long t1 = (long long)time(NULL);
	long na = name_number(tb_writer_path(a), dir, t0, t1);
	long nb = name_number(tb_writer_path(b), dir, t0, t1);
	ck_assert_msg(na >= 0, "%s", tb_writer_path(a));
	ck_assert_msg(nb == na + 1, "%s after %s", tb_writer_path(b),
		      tb_writer_path(a));
	tbr_event *ev;
	ck_assert_int_eq(tbr_read(tb_writer_path(b), &ev, err, sizeof err), 1);
	ck_assert_str_eq(ev[0].version, "brain.Event:2");
	ck_assert(ev[0].wall_time == 1.7e9);
	free(ev);
	ck_assert_int_eq(tb_writer_close(a), 0);
	ck_assert_int_eq(tb_writer_close(b), 0);
	tu_tmpdir_free(dir);
}
END_TEST

/* Failures are reported, never fatal: a folder that is not there, a full
 * disk (/dev/full), a tag too long for an event. */
START_TEST(test_write_errors)
{
	char err[512];
	tb_writer *w =
	    tb_writer_open("/nonexistent-epjit-dir", 1.7e9, err, sizeof err);
	ck_assert_ptr_null(w);
	ck_assert_msg(strstr(err, "/nonexistent-epjit-dir/events.out."), "%s",
		      err);
	if (access("/dev/full", W_OK) == 0) {
		w = tb_writer_open_path("/dev/full", 1.7e9, err, sizeof err);
		ck_assert_ptr_null(w);
		ck_assert_msg(strstr(err, "/dev/full") &&
				  strstr(err, strerror(ENOSPC)),
			      "%s", err);
	}
	char *dir = tu_tmpdir_new("tb");
	char path[512], tag[2000];
	snprintf(path, sizeof path, "%s/events", dir);
	w = tb_writer_open_path(path, 1.7e9, err, sizeof err);
	ck_assert_msg(w != NULL, "%s", err);
	memset(tag, 'a', sizeof tag - 1);
	tag[sizeof tag - 1] = '\0';
	ck_assert_int_eq(tb_writer_scalar(w, 1.7e9, 1, tag, 1.0f), -1);
	/* the error is reported once, by the next flush */
	ck_assert_int_eq(tb_writer_flush(w), -1);
	ck_assert_int_eq(tb_writer_flush(w), 0);
	ck_assert_int_eq(tb_writer_scalar(w, 1.7e9, 1, "ok", 1.0f), 0);
	ck_assert_int_eq(tb_writer_close(w), 0);
	tbr_event *ev;
	ck_assert_int_eq(tbr_read(path, &ev, err, sizeof err), 2);
	ck_assert_str_eq(ev[1].tag, "ok");
	free(ev);
	tu_tmpdir_free(dir);
}
END_TEST

Suite *make_tensorboard_suite(void)
{
	Suite *s = suite_create("tensorboard");
	TCase *tc = tcase_create("core");
	tcase_add_test(tc, test_crc32c);
	tcase_add_test(tc, test_golden_bytes);
	tcase_add_test(tc, test_random_round_trip);
	tcase_add_test(tc, test_file_name);
	tcase_add_test(tc, test_write_errors);
	suite_add_tcase(s, tc);
	return s;
}

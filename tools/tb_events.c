/* tools/tb_events.c -- TensorBoard event files: TFRecord framing, the Event
 * protobuf, CRC-32C (see tb_events.h for the layout).
 *
 * The protobuf encoding is written by hand for the four fields scalars need
 * (field numbers from TensorFlow's event.proto and summary.proto):
 *
 *   Event   { double wall_time = 1; int64 step = 2;
 *             string file_version = 3; Summary summary = 5; }
 *   Summary { repeated Value value = 1; }
 *   Value   { string tag = 1; float simple_value = 2; }
 *
 * Every key is a varint (field << 3 | wire type): wire type 0 varint, 1
 * 64-bit, 2 length-delimited, 5 32-bit; fixed-width numbers are
 * little-endian.  simple_value belongs to a oneof, so it is written even
 * when it is 0.  The bytes do not depend on the host's byte order.
 */
#include "tb_events.h"

#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* ---- CRC-32C ---- */

static uint32_t crc_table[256];
static bool crc_table_ready;

uint32_t tb_crc32c(const void *data, size_t n)
{
	if (!crc_table_ready) {
		for (uint32_t i = 0; i < 256; i++) {
			uint32_t c = i;
			for (int k = 0; k < 8; k++)
				c = c & 1 ? (c >> 1) ^ 0x82F63B78u : c >> 1;
			crc_table[i] = c;
		}
		crc_table_ready = true;
	}
	const uint8_t *p = data;
	uint32_t c = 0xFFFFFFFFu;
	for (size_t i = 0; i < n; i++)
		c = crc_table[(c ^ p[i]) & 0xFF] ^ (c >> 8);
	return c ^ 0xFFFFFFFFu;
}

uint32_t tb_crc_mask(uint32_t crc)
{
	return ((crc >> 15) | (crc << 17)) + 0xa282ead8u;
}

/* ---- protobuf ---- */

/* A bounded output buffer: `len` keeps counting past `cap` so that the
 * caller sees the overflow once at the end. */
typedef struct out {
	uint8_t *p;
	size_t cap, len;
} out;

static void put_byte(out *o, uint8_t b)
{
	if (o->len < o->cap)
		o->p[o->len] = b;
	o->len++;
}

static void put_varint(out *o, uint64_t v)
{
	while (v >= 0x80) {
		put_byte(o, (uint8_t)(v | 0x80));
		v >>= 7;
	}
	put_byte(o, (uint8_t)v);
}

static size_t varint_len(uint64_t v)
{
	size_t n = 1;
	while (v >= 0x80) {
		v >>= 7;
		n++;
	}
	return n;
}

static void put_le(out *o, uint64_t v, int bytes)
{
	for (int i = 0; i < bytes; i++)
		put_byte(o, (uint8_t)(v >> (8 * i)));
}

static void put_key(out *o, unsigned field, unsigned wire)
{
	put_varint(o, (uint64_t)field << 3 | wire);
}

static void put_bytes(out *o, unsigned field, const char *s, size_t n)
{
	put_key(o, field, 2);
	put_varint(o, n);
	for (size_t i = 0; i < n; i++)
		put_byte(o, (uint8_t)s[i]);
}

size_t tb_event_encode(uint8_t *buf, size_t cap, double wall_time, int64_t step,
		       const char *file_version, const char *tag, float value)
{
	out o = { buf, cap, 0 };
	uint64_t wt;
	memcpy(&wt, &wall_time, sizeof wt);
	put_key(&o, 1, 1); /* wall_time: double */
	put_le(&o, wt, 8);
	if (step != 0) {
		put_key(&o, 2, 0); /* step: int64, two's complement varint */
		put_varint(&o, (uint64_t)step);
	}
	if (file_version)
		put_bytes(&o, 3, file_version, strlen(file_version));
	if (tag) {
		size_t tn = strlen(tag);
		/* Value: tag (key, length, bytes) + simple_value (key, 4) */
		size_t vlen = 1 + varint_len(tn) + tn + 1 + 4;
		/* Summary: one Value (key, length, bytes) */
		size_t slen = 1 + varint_len(vlen) + vlen;
		put_key(&o, 5, 2); /* summary */
		put_varint(&o, slen);
		put_key(&o, 1, 2); /* Summary.value */
		put_varint(&o, vlen);
		put_bytes(&o, 1, tag, tn); /* Value.tag */
		uint32_t fv;
		memcpy(&fv, &value, sizeof fv);
		put_key(&o, 2, 5); /* Value.simple_value: float */
		put_le(&o, fv, 4);
	}
	return o.len <= cap ? o.len : 0;
}

/* ---- the file ---- */

struct tb_writer {
	FILE *f;
	int err; /* errno of the first failed write since the last check */
	char path[4352];
};

/* Files opened by this process: the <n> of the name. */
static unsigned files_opened;

/* One TFRecord: length, its masked CRC, the data, the data's masked CRC. */
static int write_record(tb_writer *w, const uint8_t *data, size_t n)
{
	uint8_t hdr[12], tail[4];
	for (int i = 0; i < 8; i++)
		hdr[i] = (uint8_t)((uint64_t)n >> (8 * i));
	uint32_t c = tb_crc_mask(tb_crc32c(hdr, 8));
	uint32_t d = tb_crc_mask(tb_crc32c(data, n));
	for (int i = 0; i < 4; i++) {
		hdr[8 + i] = (uint8_t)(c >> (8 * i));
		tail[i] = (uint8_t)(d >> (8 * i));
	}
	errno = 0; /* a short fwrite need not set it */
	if (fwrite(hdr, 1, sizeof hdr, w->f) != sizeof hdr ||
	    fwrite(data, 1, n, w->f) != n ||
	    fwrite(tail, 1, sizeof tail, w->f) != sizeof tail) {
		if (!w->err)
			w->err = errno ? errno : EIO;
		return -1;
	}
	return 0;
}

tb_writer *tb_writer_open_path(const char *path, double wall_time, char *err,
			       size_t errn)
{
	tb_writer *w = calloc(1, sizeof *w);
	if (!w) {
		snprintf(err, errn, "%s: out of memory", path);
		return NULL;
	}
	snprintf(w->path, sizeof w->path, "%s", path);
	w->f = fopen(path, "wb");
	if (!w->f) {
		snprintf(err, errn, "cannot create %s: %s", path,
			 strerror(errno));
		free(w);
		return NULL;
	}
	files_opened++;
	uint8_t buf[64];
	size_t n = tb_event_encode(buf, sizeof buf, wall_time, 0,
				   "brain.Event:2", NULL, 0);
	if (write_record(w, buf, n) || tb_writer_flush(w)) {
		/* flush hands its error back through errno */
		snprintf(err, errn, "cannot write %s: %s", path,
			 strerror(w->err ? w->err : errno));
		fclose(w->f);
		free(w);
		return NULL;
	}
	return w;
}

tb_writer *tb_writer_open(const char *dir, double wall_time, char *err,
			  size_t errn)
{
	char host[256] = "localhost", path[4352];
	if (gethostname(host, sizeof host) != 0 || !host[0])
		snprintf(host, sizeof host, "localhost");
	host[sizeof host - 1] = '\0';
	for (char *c = host; *c; c++)
		if (*c == '/')
			*c = '_';
	int len = snprintf(
	    path, sizeof path, "%s/events.out.tfevents.%010lld.%s.%ld.%u", dir,
	    (long long)time(NULL), host, (long)getpid(), files_opened);
	if (len < 0 || (size_t)len >= sizeof path) {
		snprintf(err, errn, "%s: path too long", dir);
		return NULL;
	}
	return tb_writer_open_path(path, wall_time, err, errn);
}

const char *tb_writer_path(const tb_writer *w)
{
	return w->path;
}

int tb_writer_scalar(tb_writer *w, double wall_time, int64_t step,
		     const char *tag, float value)
{
	uint8_t buf[1024];
	size_t n =
	    tb_event_encode(buf, sizeof buf, wall_time, step, NULL, tag, value);
	if (n == 0) {
		errno = ENAMETOOLONG; /* only a tag can make it that long */
		if (!w->err)
			w->err = errno;
		return -1;
	}
	return write_record(w, buf, n);
}

int tb_writer_flush(tb_writer *w)
{
	errno = 0;
	if (fflush(w->f) != 0 && !w->err)
		w->err = errno ? errno : EIO;
	if (!w->err)
		return 0;
	errno = w->err;
	w->err = 0;
	return -1;
}

int tb_writer_close(tb_writer *w)
{
	if (!w)
		return 0;
	int rc = tb_writer_flush(w);
	int e = errno;
	if (fclose(w->f) != 0 && rc == 0) {
		rc = -1;
		e = errno;
	}
	free(w);
	errno = e;
	return rc;
}

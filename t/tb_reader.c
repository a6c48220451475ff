/* t/tb_reader.c -- see tb_reader.h.  The record layout is TFRecord's:
 * u64 length, u32 masked CRC-32C of the 8 length bytes, the data, u32
 * masked CRC-32C of the data, all little-endian. */
#include "tb_reader.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

uint32_t tbr_crc32c(const void *data, size_t n)
{
	const unsigned char *p = data;
	uint32_t c = ~0u;
	for (size_t i = 0; i < n; i++) {
		c ^= p[i];
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
	}
	return ~c;
}

uint32_t tbr_mask(uint32_t crc)
{
	uint32_t rot = (crc >> 15) | (crc << 17);
	return rot + 0xa282ead8u;
}

static uint64_t le(const unsigned char *p, int n)
{
	uint64_t v = 0;
	for (int i = n - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

/* A protobuf cursor over [p, end). */
typedef struct pb {
	const unsigned char *p, *end;
} pb;

static bool pb_varint(pb *b, uint64_t *v)
{
	*v = 0;
	for (int s = 0; s < 64; s += 7) {
		if (b->p >= b->end)
			return false;
		unsigned char c = *b->p++;
		*v |= (uint64_t)(c & 0x7f) << s;
		if (!(c & 0x80))
			return true;
	}
	return false;
}

/* The next field: its number, wire type, and for wire type 2 its bytes,
 * for 0 its varint, for 1 and 5 its little-endian value. */
typedef struct field {
	unsigned num, wire;
	uint64_t v;
	const unsigned char *bytes;
	size_t len;
} field;

static bool pb_next(pb *b, field *f)
{
	uint64_t key;
	if (!pb_varint(b, &key) || key >> 3 == 0 || key >> 3 > 0x1fffffff)
		return false;
	f->num = (unsigned)(key >> 3);
	f->wire = (unsigned)(key & 7);
	switch (f->wire) {
	case 0:
		return pb_varint(b, &f->v);
	case 1:
	case 5: {
		int n = f->wire == 1 ? 8 : 4;
		if (b->end - b->p < n)
			return false;
		f->v = le(b->p, n);
		b->p += n;
		return true;
	}
	case 2:
		if (!pb_varint(b, &f->v) || f->v > (uint64_t)(b->end - b->p))
			return false;
		f->bytes = b->p;
		f->len = (size_t)f->v;
		b->p += f->len;
		return true;
	default:
		return false;
	}
}

static bool copy_str(char *dst, size_t cap, const field *f)
{
	if (f->wire != 2 || f->len >= cap)
		return false;
	memcpy(dst, f->bytes, f->len);
	dst[f->len] = '\0';
	return true;
}

/* Summary.Value { tag = 1; simple_value = 2 (float) } */
static const char *read_value(const unsigned char *p, size_t n, tbr_event *e)
{
	pb b = { p, p + n };
	field f;
	bool has_tag = false;
	while (b.p < b.end) {
		if (!pb_next(&b, &f))
			return "malformed Summary.Value";
		if (f.num == 1) {
			if (!copy_str(e->tag, sizeof e->tag, &f))
				return "bad Summary.Value.tag";
			has_tag = true;
		} else if (f.num == 2) {
			if (f.wire != 5)
				return "simple_value is not a 32-bit field";
			uint32_t u = (uint32_t)f.v;
			memcpy(&e->value, &u, sizeof u);
			e->has_value = true;
		}
	}
	if (!has_tag || !e->has_value)
		return "a Summary.Value without tag or simple_value";
	return NULL;
}

/* Summary { repeated Value value = 1 }: exactly one value here. */
static const char *read_summary(const unsigned char *p, size_t n, tbr_event *e)
{
	pb b = { p, p + n };
	field f;
	int values = 0;
	while (b.p < b.end) {
		if (!pb_next(&b, &f))
			return "malformed Summary";
		if (f.num != 1)
			continue;
		if (f.wire != 2 || values++)
			return "a Summary with more than one value";
		const char *m = read_value(f.bytes, f.len, e);
		if (m)
			return m;
	}
	return values == 1 ? NULL : "a Summary without a value";
}

/* Event { wall_time = 1 (double); step = 2; file_version = 3;
 * summary = 5 } */
static const char *read_event(const unsigned char *p, size_t n, tbr_event *e)
{
	pb b = { p, p + n };
	field f;
	memset(e, 0, sizeof *e);
	bool has_wt = false;
	while (b.p < b.end) {
		if (!pb_next(&b, &f))
			return "malformed Event";
		switch (f.num) {
		case 1:
			if (f.wire != 1)
				return "wall_time is not a 64-bit field";
			memcpy(&e->wall_time, &f.v, sizeof e->wall_time);
			has_wt = true;
			break;
		case 2:
			if (f.wire != 0)
				return "step is not a varint";
			e->step = (int64_t)f.v;
			break;
		case 3:
			if (!copy_str(e->version, sizeof e->version, &f))
				return "bad file_version";
			e->has_version = true;
			break;
		case 5: {
			if (f.wire != 2)
				return "summary is not a message";
			const char *m = read_summary(f.bytes, f.len, e);
			if (m)
				return m;
			break;
		}
		default:
			break;
		}
	}
	return has_wt ? NULL : "an Event without wall_time";
}

int tbr_read(const char *path, tbr_event **out, char *err, size_t errn)
{
	*out = NULL;
	FILE *fp = fopen(path, "rb");
	if (!fp) {
		snprintf(err, errn, "%s: %s", path, strerror(errno));
		return -1;
	}
	unsigned char *data = NULL;
	size_t size = 0, cap = 0;
	for (;;) {
		if (size == cap) {
			cap = cap ? 2 * cap : 4096;
			unsigned char *nd = realloc(data, cap);
			if (!nd) {
				free(data);
				fclose(fp);
				snprintf(err, errn, "%s: out of memory", path);
				return -1;
			}
			data = nd;
		}
		size_t got = fread(data + size, 1, cap - size, fp);
		size += got;
		if (got == 0)
			break;
	}
	fclose(fp);
	tbr_event *ev = NULL;
	int n = 0, cap_ev = 0;
	size_t off = 0;
	const char *m = NULL;
	while (off < size) {
		if (size - off < 12) {
			m = "truncated record header";
			break;
		}
		const unsigned char *r = data + off;
		uint64_t len = le(r, 8);
		if ((uint32_t)le(r + 8, 4) != tbr_mask(tbr_crc32c(r, 8))) {
			m = "bad length CRC";
			break;
		}
		if (len > size - off - 12 || size - off - 12 - len < 4) {
			m = "truncated record";
			break;
		}
		if ((uint32_t)le(r + 12 + len, 4) !=
		    tbr_mask(tbr_crc32c(r + 12, (size_t)len))) {
			m = "bad data CRC";
			break;
		}
		if (n == cap_ev) {
			cap_ev = cap_ev ? 2 * cap_ev : 64;
			tbr_event *ne =
			    realloc(ev, (size_t)cap_ev * sizeof *ev);
			if (!ne) {
				m = "out of memory";
				break;
			}
			ev = ne;
		}
		m = read_event(r + 12, (size_t)len, &ev[n]);
		if (m)
			break;
		n++;
		off += 12 + len + 4;
	}
	free(data);
	if (m) {
		snprintf(err, errn, "%s: record %d at byte %zu: %s", path, n,
			 off, m);
		free(ev);
		return -1;
	}
	*out = ev;
	return n;
}

/* t/tb_reader.h -- an independent reader of TensorBoard event files, for the
 * tests of the trainer's writer (tools/tb_events.c).  It shares no code with
 * the writer: its CRC-32C is bitwise, its protobuf decoder generic (unknown
 * fields are skipped by wire type). */
#ifndef EPJIT_TB_READER_H
#define EPJIT_TB_READER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

typedef struct tbr_event {
	double wall_time;
	int64_t step;
	bool has_version; /* file_version given */
	char version[64];
	bool has_value; /* a summary with one Value with a simple_value */
	char tag[256];
	float value;
} tbr_event;

/* CRC-32C, bit by bit. */
uint32_t tbr_crc32c(const void *data, size_t n);
/* TFRecord's masked CRC. */
uint32_t tbr_mask(uint32_t crc);

/* Reads every record of path (framing, both CRCs) and decodes its Event.
 * Returns the number of events with *out (free() it), or -1 with the
 * reason (the record's byte offset) in err.  A summary with more or fewer
 * than one value, or a value without simple_value, is an error. */
int tbr_read(const char *path, tbr_event **out, char *err, size_t errn);

#endif

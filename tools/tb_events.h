/* tools/tb_events.h -- a minimal TensorBoard event file writer (scalars).
 *
 * epjit-train's tensorboard monitor.  A file is a sequence of TFRecord
 * records, each holding one serialized `Event` protobuf:
 *
 *   u64 length (little-endian) | u32 masked CRC-32C of those 8 bytes |
 *   length bytes of data       | u32 masked CRC-32C of the data
 *
 * The first event carries file_version "brain.Event:2"; each scalar is one
 * event (wall_time, step, summary { value { tag, simple_value } }), as
 * TensorBoard's own SummaryWriter.add_scalar writes it.  Nothing here
 * allocates after tb_writer_open, and no error ends the process: every call
 * returns 0 or -1 with errno set.
 */
#ifndef EPJIT_TB_EVENTS_H
#define EPJIT_TB_EVENTS_H

#include <stddef.h>
#include <stdint.h>

/* CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of n bytes. */
uint32_t tb_crc32c(const void *data, size_t n);
/* TFRecord's masked CRC: rotate right by 15, add 0xa282ead8. */
uint32_t tb_crc_mask(uint32_t crc);

/* Serializes one Event into buf (capacity cap); returns its length, or 0
 * when it does not fit.  step 0 is left out, as protobuf leaves out a zero
 * scalar field; file_version (NULL: none) and tag (NULL: no summary) are
 * NUL-terminated strings. */
size_t tb_event_encode(uint8_t *buf, size_t cap, double wall_time, int64_t step,
		       const char *file_version, const char *tag, float value);

typedef struct tb_writer tb_writer;

/* Creates the file (dir must exist)
 * dir/events.out.tfevents.<unix time, 10 digits>.<host>.<pid>.<n> (n counts
 * the files this process opened, from 0, as TensorBoard's writer does), and
 * writes and flushes the file_version event stamped wall_time.  On failure
 * returns NULL and writes the reason, naming the path, to err. */
tb_writer *tb_writer_open(const char *dir, double wall_time, char *err,
			  size_t errn);
/* Opens exactly `path` (truncating it) instead: for tests. */
tb_writer *tb_writer_open_path(const char *path, double wall_time, char *err,
			       size_t errn);
const char *tb_writer_path(const tb_writer *w);
/* Appends one scalar event (buffered until tb_writer_flush). */
int tb_writer_scalar(tb_writer *w, double wall_time, int64_t step,
		     const char *tag, float value);
/* Hands everything appended so far to the kernel (whole records). */
int tb_writer_flush(tb_writer *w);
/* Flushes and closes; NULL is a no-op.  Returns -1 when anything written
 * since the last check failed. */
int tb_writer_close(tb_writer *w);

#endif

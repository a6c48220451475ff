/* devices.c -- the registry of devices: one row per device.
 *
 * Each device defines its descriptor (ej_device_desc, core_impl.h) in its
 * own file: cpu in alloc.c, cuda-sim in device_sim.c, cuda in
 * device_cuda.c.  Everything above lib asks the descriptor what a device
 * does (its default codegen backend, whether it runs CUDA C, its collective
 * library, whether it reruns grids, whether its GEMMs may go to cuBLASLt)
 * and names no device; a new device is its file plus a row here.
 */
#include "core_impl.h"

#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* Each descriptor, in its device's file. */
extern const ej_device_desc ej_desc_cpu, ej_desc_sim, ej_desc_cuda;

static const ej_device_desc *const registry[] = {
	&ej_desc_cpu,
	&ej_desc_sim,
	&ej_desc_cuda,
};

const ej_device_desc *ej_device_find(const char *name)
{
	if (!name)
		return NULL;
	for (size_t i = 0; i < EJ_ARRAY_LEN(registry); i++)
		if (!strcmp(registry[i]->name, name))
			return registry[i];
	return NULL;
}

bool epj_device_known(const char *name)
{
	return ej_device_find(name) != NULL;
}

static char names[128];
static const char *name_list[EJ_ARRAY_LEN(registry)];
static pthread_once_t names_once = PTHREAD_ONCE_INIT;

static void names_build(void)
{
	size_t off = 0;
	for (size_t i = 0; i < EJ_ARRAY_LEN(registry); i++) {
		name_list[i] = registry[i]->name;
		off += (size_t)snprintf(names + off, sizeof names - off, "%s%s",
					i ? ", " : "", registry[i]->name);
	}
}

const char *const *ej_device_list(int *n)
{
	pthread_once(&names_once, names_build);
	*n = (int)EJ_ARRAY_LEN(registry);
	return name_list;
}

const char *epj_device_names(void)
{
	pthread_once(&names_once, names_build);
	return names;
}

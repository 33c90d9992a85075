/* RDMA devices on this host, through libibverbs loaded at run time. */
#ifndef MC_TRANSPORT_RDMA_DEVICES_H
#define MC_TRANSPORT_RDMA_DEVICES_H

#include <stddef.h>

#include "util/errors.h"

/* Lists the verbs devices into buf as "rxe0, rxe1" (empty if none); returns
 * their count, or MC_EUNAVAIL when libibverbs cannot be loaded. */
int mc_rdma_list_devices(char *buf, size_t len, mc_err_t *err);

/* Checks a device_name value ("nic0[,nic1...]") against the devices that
 * exist.  0 if all exist; MC_EUNAVAIL if there is no RDMA device at all or
 * no libibverbs; MC_EINVAL naming the missing device and listing those that
 * exist. */
int mc_rdma_check_devices(const char *device_name, mc_err_t *err);

#endif

/* The registered transports (registry.c), in order of preference: the
 * engine starts every one and chooses among them by capability
 * (transport.h).  A new transport = its folder + one line in registry.c. */
#ifndef MC_TRANSPORT_REGISTRY_H
#define MC_TRANSPORT_REGISTRY_H

#include <stddef.h>

#include "transport/transport.h"

/* NULL-terminated, at most MC_TRANSPORT_MAX entries. */
extern const mc_transport_ops_t *const mc_transport_registry[];

#endif

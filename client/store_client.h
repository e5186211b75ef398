#pragma once

// The client's names for the remote store and its channel (net/store_client.h): trainers, tools
// and the C ABI reach them as gradsync::client::*.

#include "net/store_client.h"

namespace gradsync::client {

using net::Authorize;
using net::ClientOptions;
using net::Connect;
using net::NormalizeTarget;
using net::StoreClient;

}  // namespace gradsync::client

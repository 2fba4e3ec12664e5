// A model named as on the HuggingFace Hub ("Qwen/Qwen3-1.7B"), found in the
// local HuggingFace cache as transformers' from_pretrained finds it offline.
#pragma once

#include <string>

namespace roundpipe::train {

// Note [Model names]
// --model takes a directory or a Hub name. A name resolves to the cached
// snapshot: the hub cache is $HF_HUB_CACHE, else $HF_HOME/hub, else
// $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub; a repo
// "org/name" lives in "models--org--name", its revision in refs/main (else
// its only snapshot). A bare "name" matches "models--*--name" where exactly
// one does. Nothing is downloaded: a missing model is an error naming the
// cache and the command that fetches it.
std::string resolve_model_path(const std::string& model);

// The hub cache directory the rules above pick.
std::string huggingface_hub_cache();

}  // namespace roundpipe::train

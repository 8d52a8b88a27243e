index_first_axis = pad_input = unpad_input = None
